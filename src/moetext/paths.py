"""Paths from the user, resolved once at the boundary: every CLI flag and every path-valued
config key becomes an absolute path before anything reads or writes it.

`resolve` expands `~` (the shell does not expand it in `key=~/x` or `--flag=~/x`), makes a
relative path absolute against the working directory and drops a trailing slash; a URI
(`gs://bucket/run`) is left exactly as given. Symlinks are kept, not resolved: the path the
user named is the one recorded in configs and logs. Orbax and TFDS need absolute paths (orbax
reads no tree metadata under a relative one), and a run that records absolute paths reads
the same files from any working directory.

The checks (`existing_dir`, `existing_file`, `existing`, `writable_dir`, `new_dir`) raise
PathError naming the flag or config key the path came from and what was expected: the CLIs
print it as one line and exit 2 before writing anything.
"""

from __future__ import annotations

import os

from etils import epath

from moetext.errors import ConfigError


class PathError(ConfigError):
    """A path that does not exist, is not what is needed there, or is not writable."""


def is_uri(path: str | os.PathLike[str]) -> bool:
    """gs://, s3://, ...: a remote filesystem, handled by etils.epath as given."""
    return "://" in os.fspath(path)


def resolve(path: str | os.PathLike[str]) -> str:
    """`path` absolute: `~` expanded, relative to the working directory, no trailing slash;
    a URI unchanged."""
    text = os.fspath(path)
    if is_uri(text):
        return text
    return os.path.abspath(os.path.expanduser(text))


def user_cache_dir(env: str, name: str) -> str:
    """Where moetext keeps what it prepares or compiles for later runs: $ENV (`~` expanded),
    else $XDG_CACHE_HOME/moetext/NAME, else ~/.cache/moetext/NAME."""
    if os.environ.get(env):
        return os.path.expanduser(os.environ[env])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "moetext", name)


def as_epath(path: str | os.PathLike[str]) -> epath.Path:
    """`resolve(path)` as an etils.epath.Path (local or remote)."""
    return epath.Path(resolve(path))


def _fail(where: str, path: str | os.PathLike[str], why: str) -> PathError:
    return PathError(f"{where} {os.fspath(path)!r}: {why}")


def existing(path: str | os.PathLike[str], where: str) -> epath.Path:
    """The resolved path, which must exist (a file or a directory)."""
    p = as_epath(path)
    if not p.exists():
        raise _fail(where, path, "no such file or directory")
    return p


def existing_dir(path: str | os.PathLike[str], where: str) -> epath.Path:
    """The resolved path, which must be an existing directory."""
    p = existing(path, where)
    if not p.is_dir():
        raise _fail(where, path, "not a directory")
    return p


def existing_file(path: str | os.PathLike[str], where: str) -> epath.Path:
    """The resolved path, which must be an existing file."""
    p = existing(path, where)
    if p.is_dir():
        raise _fail(where, path, "a directory, expected a file")
    return p


def writable_dir(path: str | os.PathLike[str], where: str) -> epath.Path:
    """The resolved path of a directory that exists and is writable, or can be created (its
    nearest existing ancestor is a writable directory). Creates nothing; remote paths pass."""
    p = as_epath(path)
    if not is_uri(p):
        if p.exists() and not p.is_dir():
            raise _fail(where, path, "exists and is not a directory")
        _creatable(os.fspath(p), where, path)
    return p


def _creatable(local: str, where: str, path: str | os.PathLike[str]) -> None:
    """`local` exists as a writable directory or can be created: its nearest existing
    ancestor is a writable directory."""
    ancestor = local
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise _fail(where, path, f"{ancestor!r} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _fail(where, path, f"{ancestor!r} is not writable")


def new_dir(path: str | os.PathLike[str], where: str, *, overwrite: bool) -> epath.Path:
    """The resolved path of an output directory to create: it must not exist or be empty
    (unless `overwrite`), and its parent must be creatable and writable. Creates nothing."""
    p = writable_dir(path, where)
    empty_dir = p.is_dir() and not any(p.iterdir())
    if p.exists() and not empty_dir and not overwrite:
        raise _fail(where, path, "already exists (pass --overwrite to replace it)")
    return p


def writable_file(path: str | os.PathLike[str], where: str) -> epath.Path:
    """The resolved path of an output file: not a directory, in a directory that exists or
    can be created and is writable. Creates nothing."""
    p = as_epath(path)
    if p.is_dir():
        raise _fail(where, path, "a directory, expected a file name")
    if not is_uri(p):
        _creatable(os.fspath(p.parent), where, path)
    return p
