"""Quantization recipes by name: `make_recipe(name, options)` for configs, `register_recipe`.

A recipe is a frozen dataclass subclassing `gmm.Recipe`; its fields are its options (the
`kernels.recipe` mapping of a config), checked by its own `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from moetext.kernels.gmm.recipe import Recipe

_RECIPES: dict[str, type[Recipe]] = {}


def register_recipe(cls: type[Recipe]) -> type[Recipe]:
    """Makes `cls` available as `make_recipe(cls.name, ...)`."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(
            f"register_recipe: {cls.__name__} must be a dataclass (its fields are its options)"
        )
    _RECIPES[cls.name] = cls
    return cls


def available_recipes() -> list[str]:
    return sorted(_RECIPES)


def make_recipe(name: str, options: Mapping[str, Any] | None = None) -> Recipe:
    """The recipe `name` with `options` (its dataclass fields; the rest keep their defaults).

    An unknown name or option is a ValueError naming the nearest valid one and listing all.
    """
    if name not in _RECIPES:
        raise ValueError(
            f"unknown quantization recipe {name!r}{_near(name, _RECIPES)}; valid names: "
            f"{', '.join(available_recipes())}"
        )
    cls = _RECIPES[name]
    assert dataclasses.is_dataclass(cls)  # register_recipe admits dataclasses only
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in options or {}:
        if key not in fields:
            valid = f"its options: {', '.join(fields)}" if fields else "it takes no options"
            raise ValueError(
                f"quantization recipe {name!r} has no option {key!r}{_near(key, fields)}; {valid}"
            )
    return cls(**dict(options or {}))


def _near(key: str, names: Mapping[str, Any] | list[str]) -> str:
    near = difflib.get_close_matches(str(key), list(names), n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else ""
