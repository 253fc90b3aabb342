"""The config reference (docs/config.md), rendered from the field docstrings of `schema`.

Field docstrings are string statements after each annotated field; Python keeps none of them at
runtime, so the schema's source is read with `ast`. `scripts/gen_config_docs.py` writes the
result; a test checks the checked-in file is current.
"""

from __future__ import annotations

import ast
import inspect

from moetext.config import schema

HEADER = """# Config reference

Generated from `src/moetext/config/schema.py` by `scripts/gen_config_docs.py`; do not edit.

A run's YAML has one mapping per section below. `base_config: path.yml` (or a list) inherits
from other files (child keys win, mappings merge deeply). On the command line,
`section.key=value` overrides any field; values parse as YAML and are checked against the
field's type. Unknown keys are errors that name the nearest valid key.
"""


def _rows(cls: ast.ClassDef) -> list[str]:
    """One table row per annotated field of cls: key, type, default, docstring."""
    rows = []
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = ""
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr):
            # One table cell: a docstring wrapped over lines is joined into one.
            doc = " ".join(ast.literal_eval(after.value).split()).replace("|", "\\|")
        default = _default(node.value, cls.name)
        typ = ast.unparse(node.annotation).replace("|", "\\|")
        rows.append(f"| `{node.target.id}` | `{typ}` | `{default}` | {doc} |")
    return rows


# Calls that make a field around its default: dataclasses' and config/fields.py's.
_FIELD_MAKERS = {"field", "shapes_params", "must_match", "resume_safe", "resume_safe_if"}


def _default(value: ast.expr | None, cls: str) -> str:
    """The default as written: `x` of `x`, of `field(default=x)` and of a declaration helper's
    `resume_safe(x)` (config/fields.py); a default_factory shows as {} (a section: see it)."""
    if value is None:
        return ""
    if isinstance(value, ast.Call) and ast.unparse(value.func) in _FIELD_MAKERS:
        if any(k.arg == "default_factory" for k in value.keywords):
            return "see section" if cls == "Config" else "{}"
        given = [k.value for k in value.keywords if k.arg == "default"] or value.args[:1]
        if given:
            return ast.unparse(given[0])
    return ast.unparse(value)


def render() -> str:
    """The markdown of docs/config.md: one table per config class that has fields."""
    out = [HEADER]
    for cls in ast.parse(inspect.getsource(schema)).body:
        if not isinstance(cls, ast.ClassDef) or not (rows := _rows(cls)):
            continue
        title = "Top-level sections" if cls.name == "Config" else f"`{cls.name}`"
        out += [f"\n## {title}\n", "| key | type | default | meaning |", "|---|---|---|---|", *rows]
    return "\n".join(out) + "\n"
