"""Writes docs/config.md from the field docstrings in src/moetext/config/schema.py and the model
families' section classes (src/moetext/models/<family>/config.py).

.venv/bin/python scripts/gen_config_docs.py        # tests check the file is current
"""

from __future__ import annotations

from pathlib import Path

from moetext import models  # noqa: F401  (registers the families' config sections)
from moetext.config import docs

OUT = Path(__file__).resolve().parents[1] / "docs/config.md"

if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(docs.render())
    print(f"wrote {OUT}")
