"""Writes docs/config.md from the field docstrings in src/moetext/config/schema.py.

.venv/bin/python scripts/gen_config_docs.py        # tests check the file is current
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "src/moetext/config/schema.py"
OUT = REPO / "docs/config.md"

HEADER = """# Config reference

Generated from `src/moetext/config/schema.py` by `scripts/gen_config_docs.py`; do not edit.

A run's YAML has one mapping per section below. `base_config: path.yml` (or a list) inherits
from other files (child keys win, mappings merge deeply). On the command line,
`section.key=value` overrides any field; values parse as YAML and are checked against the
field's type. Unknown keys are errors that name the nearest valid key.
"""


def render() -> str:
    tree = ast.parse(SCHEMA.read_text())
    out = [HEADER]
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        rows = []
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = ""
                if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr):
                    # One table cell: a docstring wrapped over lines is joined into one.
                    doc = " ".join(ast.literal_eval(body[i + 1].value).split()).replace("|", "\\|")
                default = ast.unparse(node.value) if node.value is not None else ""
                if "default_factory" in default:
                    default = "see section" if cls.name == "Config" else "{}"
                typ = ast.unparse(node.annotation).replace("|", "\\|")
                rows.append(f"| `{node.target.id}` | `{typ}` | `{default}` | {doc} |")
        if not rows:
            continue
        title = "Top-level sections" if cls.name == "Config" else f"`{cls.name}`"
        out += [f"\n## {title}\n", "| key | type | default | meaning |", "|---|---|---|---|", *rows]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
