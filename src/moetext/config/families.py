"""Which `model:` / `moe:` dataclasses each model family reads: its config sections.

A family's fields that no other family has (Qwen's qk_norm, decoder_sparse_step, ...) live in
subclasses of `ModelConfig` / `MoEConfig` defined in the family's folder
(`models/<family>/config.py`) and registered with the family (`models.register_family`, which
calls `register_family_config`). In YAML they are written flat under `model:` and `moe:`, like
the shared fields; the loader reads `model.family` first and decodes both sections into that
family's classes, so a field foreign to the family is an unknown key (naming the family that has
it). This package never imports a family: registration happens when `moetext.models` is
imported, as every entry point (train, generate, convert, aot) does before loading a config.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING, Any

from moetext.errors import ConfigError

if TYPE_CHECKING:
    from moetext.config.schema import ModelConfig, MoEConfig


@dataclasses.dataclass(frozen=True)
class FamilySections:
    model: type[ModelConfig]
    moe: type[MoEConfig]


_SECTIONS: dict[str, FamilySections] = {}


def register_family_config(
    name: str, model: type[ModelConfig], moe: type[MoEConfig], *, replace: bool = False
) -> None:
    """Makes `model.family: <name>` decode `model:` into `model` and `moe:` into `moe`."""
    new = FamilySections(model, moe)
    old = _SECTIONS.get(name)
    if old is not None and old != new and not replace:
        raise ValueError(
            f"model family {name!r} already has config sections {old.model.__name__} / "
            f"{old.moe.__name__}; pass replace=True to replace them"
        )
    _SECTIONS[name] = new


def registered_families() -> list[str]:
    return sorted(_SECTIONS)


def lookup(name: str) -> FamilySections | None:
    return _SECTIONS.get(name)


def family_sections(name: Any) -> FamilySections:
    """The sections of family `name`; a ConfigError naming the registered ones otherwise."""
    if isinstance(name, str) and name in _SECTIONS:
        return _SECTIONS[name]
    near = difflib.get_close_matches(str(name), _SECTIONS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    valid = ", ".join(registered_families()) or (
        "none: model families register when moetext.models is imported; import it before "
        "loading a config"
    )
    raise ConfigError(
        f"model.family={name!r} is not a registered model family{hint}; valid names: {valid}"
    )


def owners(section: str, key: str) -> list[str]:
    """The registered families whose `section` (model or moe) has a field `key`."""
    return sorted(
        name
        for name, s in _SECTIONS.items()
        if key in {f.name for f in dataclasses.fields(getattr(s, section))}
    )


def as_family_class[T](obj: object, cls: type[T], section: str, family: str) -> T:
    """`obj` (a ModelConfig / MoEConfig, e.g. the base class built in code) as an instance of the
    family's `cls`: shared fields carried over, the family's own at their defaults. A field set
    on `obj` that `cls` lacks, at a value other than its default there, is a ConfigError."""
    if type(obj) is cls:
        return obj  # narrowed: type(obj) is cls
    mine = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.name in mine:
            kwargs[f.name] = value
        elif f.default is dataclasses.MISSING or value != f.default:
            raise ConfigError(
                f"{section}.{f.name}={value!r} is not a field of model.family={family!r} "
                f"({cls.__name__}); valid keys: {', '.join(sorted(mine))}"
            )
    return cls(**kwargs)
