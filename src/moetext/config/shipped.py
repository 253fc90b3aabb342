"""Where the configs shipped with moetext live: package data (src/moetext/configs; the
repository's configs/ links there), found with importlib.resources so a wheel install has them."""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def _shipped_configs() -> Path:
    root = importlib.resources.files("moetext") / "configs"
    return root if isinstance(root, Path) else Path(str(root))


SHIPPED_CONFIGS = _shipped_configs()
"""base.yml, models/*.yml and sharding/*.yml as shipped with moetext."""
