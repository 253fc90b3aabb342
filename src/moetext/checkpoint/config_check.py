"""Which config changes a checkpoint allows, read from the fields' own declarations
(`moetext.config.fields`): a resumed run against the config its checkpoint was saved with
(`check_config`), params loaded into another run or a conversion (`shape_mismatches`).

Both walk the fields of the actual config instances (a family's own ModelConfig subclass
included), so a field added anywhere is checked by what it declares.
"""

from __future__ import annotations

from typing import Any

from moetext.checkpoint.errors import CheckpointError
from moetext.config import Config, to_dict
from moetext.config.fields import declaration, leaves

_ABSENT = object()


def shape_mismatches(a: Config, b: Config, a_name: str, b_name: str) -> list[str]:
    """`section.field: <a_name> has X, <b_name> Y` for each field declared `shapes_params`
    (in a or in b) whose values differ."""
    in_a = {name: (f, v) for name, f, v in leaves(a)}
    in_b = {name: (f, v) for name, f, v in leaves(b)}
    out = []
    for name in [*in_a, *(n for n in in_b if n not in in_a)]:
        f = (in_a.get(name) or in_b[name])[0]
        decl = declaration(f)
        if decl is None or not decl.params:
            continue
        x = in_a[name][1] if name in in_a else _ABSENT
        y = in_b[name][1] if name in in_b else _ABSENT
        if x != y:
            out.append(f"{name}: {a_name} has {_show(x)}, {b_name} {_show(y)}")
    return out


def check_config(saved: dict[str, Any] | None, cfg: Config, where: str) -> list[str]:
    """Compares the config saved with a checkpoint against the resuming run's.

    Raises CheckpointError naming every changed field whose declaration does not allow the
    change (with both values); returns the allowed changes as "field: old -> new" (or a warning
    line when the checkpoint has no saved config). A field the saved config lacks (added to the
    schema since) counts as its default value; a field the schema no longer has is ignored."""
    if saved is None:
        return ["no saved config (an older checkpoint): config changes cannot be checked"]
    now = to_dict(cfg)  # values as a checkpoint saves them (tuples become lists)
    allowed: list[str] = []
    blocking: list[str] = []
    for name, f, _ in sorted(leaves(cfg), key=lambda leaf: leaf[0]):
        new = _lookup(now, name, default=None)
        old = _lookup(saved, name, default=_default(cfg, name))
        if old == new:
            continue
        decl = declaration(f)
        line = f"{name}: {old!r} -> {new!r}"
        safe = decl is not None and decl.resume_allows(old, new)
        (allowed if safe else blocking).append(line)
    if blocking:
        raise CheckpointError(
            f"the config differs from the one {where} was saved with in fields that change the "
            f"parameters, optimizer state or data stream: {'; '.join(blocking)}. Resume with "
            f"the saved values, or start a new run (another train.run_dir)"
        )
    return allowed


def _show(value: Any) -> str:
    return "no such field" if value is _ABSENT else repr(value)


def _default(cfg: Any, name: str) -> Any:
    """The default of field `name` (dotted) in the class of the section holding it, as saved."""
    *sections, last = name.split(".")
    for s in sections:
        cfg = getattr(cfg, s)
    return to_dict(type(cfg)())[last]


def _lookup(tree: dict[str, Any], name: str, default: Any) -> Any:
    node: Any = tree
    for key in name.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node
