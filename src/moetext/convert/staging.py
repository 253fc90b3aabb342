"""Where conversions write: a staging directory next to OUT, published by one rename, so a
failed conversion leaves nothing at OUT (and an existing OUT only goes with --overwrite)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from moetext.errors import ConfigError


def refuse_existing(out: Path, overwrite: bool) -> None:
    """A ConfigError when OUT holds anything and overwrite is off (an empty directory is fine)."""
    empty_dir = out.is_dir() and not any(out.iterdir())
    if out.exists() and not empty_dir and not overwrite:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh directory next to OUT for everything the conversion writes; removed on exit
    (after `publish` has moved the result out of it, or after a failure)."""
    stage = out.parent / f".{out.name}.converting-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(done: Path, out: Path) -> None:
    """Moves the finished directory `done` (inside the staging directory) to OUT, replacing
    what refuse_existing let through."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    done.rename(out)
