"""What a checkpoint's config must match, declared on each config field (dataclass metadata).

Every field of every config section is made by one of these helpers instead of
`dataclasses.field`, and so says two things about itself:

    shapes_params(d)        decides a parameter's shape or meaning: params loaded from another
                            checkpoint (load_params_from, conversion) must match it, and so must
                            a resumed run
    must_match(d)           a resumed run must keep it (it changes the optimizer state's
                            structure or the training data stream), loaded params need not
    resume_safe(d)          may change when a run resumes (how, not what, is computed)
    resume_safe_if(d, when=pred)  may change on resume when pred(old, new) holds

    vocab_size: int = shapes_params(32000)
    \"\"\"Vocabulary size (embedding rows and LM-head columns).\"\"\"

Each takes the default as its one positional argument, or `default_factory=`. A field whose
value is itself a config section (a dataclass) declares nothing: its own fields do.
`moetext.checkpoint` reads the declarations (`check_config`, `shape_mismatches`) by walking the
fields of the actual instances, so a section's subclass (a family's own ModelConfig) declares
its extra fields with the same helpers; tests/config/test_fields.py fails on a field without
a declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

KEY = "moetext.checkpoint"  # the field-metadata key holding a Declaration
Predicate = Callable[[Any, Any], bool]


@dataclasses.dataclass(frozen=True)
class Declaration:
    resume: Literal["safe", "must_match"] | Predicate
    """May the field differ between a checkpoint and the run resuming it: always (safe),
    never (must_match), or when the predicate (old, new) holds."""
    params: bool
    """Loaded params must match it (it decides a parameter's shape or meaning)."""

    def resume_allows(self, old: Any, new: Any) -> bool:
        """Whether a resume may change the field from `old` to `new` (plain values, as saved)."""
        if self.resume == "safe":
            return True
        if self.resume == "must_match":
            return False
        return bool(self.resume(old, new))


def _field(decl: Declaration, default: Any, default_factory: Any) -> Any:
    metadata = {KEY: decl}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@overload
def shapes_params[T](default: T, /) -> T: ...
@overload
def shapes_params[T](*, default_factory: Callable[[], T]) -> T: ...
def shapes_params(
    default: Any = dataclasses.MISSING, /, *, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A field that decides a parameter's shape or meaning (loaded params and a resume match it)."""
    return _field(Declaration("must_match", params=True), default, default_factory)


@overload
def must_match[T](default: T, /) -> T: ...
@overload
def must_match[T](*, default_factory: Callable[[], T]) -> T: ...
def must_match(
    default: Any = dataclasses.MISSING, /, *, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A field a resumed run must keep (optimizer state, data stream); loaded params need not."""
    return _field(Declaration("must_match", params=False), default, default_factory)


@overload
def resume_safe[T](default: T, /) -> T: ...
@overload
def resume_safe[T](*, default_factory: Callable[[], T]) -> T: ...
def resume_safe(
    default: Any = dataclasses.MISSING, /, *, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A field a resumed run may change."""
    return _field(Declaration("safe", params=False), default, default_factory)


def resume_safe_if[T](default: T, /, *, when: Predicate) -> T:
    """A field a resumed run may change from old to new when `when(old, new)` holds (plain
    values, as the checkpoint saved them)."""
    out: T = _field(Declaration(when, params=False), default, dataclasses.MISSING)
    return out


def declaration(f: dataclasses.Field[Any]) -> Declaration | None:
    decl = f.metadata.get(KEY)
    return decl if isinstance(decl, Declaration) else None


def leaves(
    cfg: DataclassInstance, prefix: str = ""
) -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted name, field, value) of every field of `cfg` and of its sections (fields whose
    value is a dataclass), recursively, in declaration order; the fields of each instance's own
    class (a subclass's extra fields included)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def undeclared(cfg: DataclassInstance) -> list[str]:
    """Dotted names of the fields of `cfg` (and its sections) made without a declaration."""
    return [name for name, f, _ in leaves(cfg) if declaration(f) is None]
