"""A checkpoint's `meta` item: the step and the resolved config it was saved with.

Every moetext checkpoint directory (a run's `checkpoints/<step>/`, a conversion's output) holds
`state/` (the orbax PyTree of arrays) and `meta/metadata` (JSON: `step`, `config` as
`config.to_dict` writes it, and for a conversion `converted_from`).
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

from moetext.checkpoint.errors import Broken
from moetext.config import Config, from_dict
from moetext.errors import ConfigError

STATE, META = "state", "meta"


def meta_path(directory: epath.PathLike) -> epath.Path:
    return epath.Path(directory) / META / "metadata"


def read_meta_config(directory: epath.PathLike) -> Config:
    """The config saved in a checkpoint directory's meta/ (a run's step or a conversion)."""
    d = epath.Path(directory)
    meta = meta_path(d)
    if not (d / STATE).is_dir() or not meta.exists():
        raise ConfigError(
            f"{d} is not a moetext checkpoint (needs state/ and meta/: a run's "
            "checkpoints/<step>/ or the output of python -m moetext.convert hf-to-orbax)"
        )
    saved = read_json(meta).get("config")
    if saved is None:
        raise ConfigError(f"{meta} holds no config")
    return from_dict(saved)


def read_json(path: epath.Path) -> Any:
    """A JSON file of a checkpoint; Broken (naming item/file and why) when unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        rel = f"{path.parent.name}/{path.name}"
        raise Broken(f"{rel} is unreadable: {type(e).__name__}: {e}") from None
