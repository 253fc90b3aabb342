"""The config reference (docs/config.md), rendered from the field docstrings of `schema` and of
the registered model families' section classes (config/families.py).

Field docstrings are string statements after each annotated field; Python keeps none of them at
runtime, so the source is read with `ast`. `scripts/gen_config_docs.py` writes the result (after
importing moetext.models, which registers the families); a test checks the checked-in file is
current.
"""

from __future__ import annotations

import ast
import inspect

from moetext.config import families, schema

HEADER = """# Config reference

Generated from `src/moetext/config/schema.py` and the model families' section classes
(`src/moetext/models/<family>/config.py`) by `scripts/gen_config_docs.py`; do not edit.

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


TABLE = ["| key | type | default | meaning |", "|---|---|---|---|"]


def render() -> str:
    """The markdown of docs/config.md: one table per config class that has fields, then one per
    family section class with the fields it adds."""
    out = [HEADER]
    for node in ast.parse(inspect.getsource(schema)).body:
        if not isinstance(node, ast.ClassDef) or not (rows := _rows(node)):
            continue
        title = "Top-level sections" if node.name == "Config" else f"`{node.name}`"
        out += [f"\n## {title}\n", *TABLE, *rows]
    # Each family section class shipped in moetext (families registered elsewhere, e.g. by
    # tests, are not documented here), by the folder that defines it.
    seen: list[tuple[str, type]] = []
    for name in families.registered_families():
        sections = families.family_sections(name)
        pairs: tuple[tuple[str, type], ...] = (("model", sections.model), ("moe", sections.moe))
        for section, cls in pairs:
            shipped = cls.__module__.startswith("moetext.models.")
            if shipped and cls not in (schema.ModelConfig, schema.MoEConfig):
                if (section, cls) not in seen:
                    seen.append((section, cls))
    for section, cls in seen:
        (node,) = ast.parse(inspect.getsource(cls)).body
        assert isinstance(node, ast.ClassDef)
        folder = "/".join(cls.__module__.split(".")[1:-1])
        title = f"`{cls.__name__}`: more `{section}` fields of the families in `{folder}/`"
        out += [f"\n## {title}\n", *TABLE, *_rows(node)]
    return "\n".join(out) + "\n"
