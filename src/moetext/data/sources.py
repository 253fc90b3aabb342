"""Documents from local text files, streamed one at a time, each with a stable unique key.

Formats: `.txt` (the whole file is one document, or with txt_mode="blank_lines" each block
of lines between blank lines is one), `.jsonl` and `.jsonl.gz` (each non-blank line is a JSON
object whose `text_key` field is one document). An --input is a file, a directory (searched
recursively for those extensions; hidden entries skipped) or a glob; files are read in sorted
order so a corpus always yields the same documents in the same order.

A document's key is its file's path relative to the inputs' common directory, plus
":<line>" (jsonl) or "#<block>" (blank_lines): keys are unique across the corpus, and the
train/eval split, a hash of the key, does not move when files are added under that directory.

Files are read line by line (gzip is streamed too); only a .txt document in "file" mode is
one whole file in memory, because it is one document. Bytes that are not valid UTF-8 yield a
document with text=None: the caller skips and counts it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

EXTENSIONS = (".jsonl.gz", ".jsonl", ".txt")
TxtMode = Literal["file", "blank_lines"]


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute
    key: str  # path relative to the inputs' common directory, "/"-separated


@dataclass(frozen=True)
class Document:
    key: str  # unique in the corpus
    where: str  # "path:line" for messages
    text: str | None  # None: the bytes are not valid UTF-8


def _supported(path: str) -> bool:
    return path.endswith(EXTENSIONS)


def _check_supported(path: str) -> None:
    if not _supported(path):
        raise ValueError(
            f"{path}: unsupported file type (supported: {', '.join(sorted(EXTENSIONS))})"
        )


def _walk(directory: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if not f.startswith(".") and _supported(f)]
    if not found:
        raise ValueError(
            f"--input {directory}: the directory holds no {', '.join(sorted(EXTENSIONS))} files"
        )
    return found


def resolve_inputs(inputs: Sequence[str]) -> list[SourceFile]:
    """The files the inputs name, sorted, each once. Raises before anything is read."""
    if not inputs:
        raise ValueError("no --input given: name at least one file, directory or glob")
    paths: list[str] = []
    for spec in inputs:
        spec = os.path.expanduser(spec)
        if glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise FileNotFoundError(f"--input {spec!r} matches no file")
        elif os.path.exists(spec):
            matches = [spec]
        else:
            raise FileNotFoundError(f"--input {spec}: no such file or directory")
        for m in matches:
            if os.path.isdir(m):
                paths += _walk(m)
            else:
                _check_supported(m)
                paths.append(m)
    unique = sorted({os.path.abspath(p) for p in paths})
    root = os.path.commonpath([os.path.dirname(p) for p in unique])
    return [SourceFile(p, _clean(os.path.relpath(p, root).replace(os.sep, "/"))) for p in unique]


def _clean(key: str) -> str:
    # A file name that is not valid UTF-8 arrives with surrogate escapes, which TFDS cannot
    # hash: spell those bytes as \xNN.
    return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def fingerprint(paths: Sequence[str]) -> list[dict[str, Any]]:
    """[{path, size, mtime_ns}] per file: how a changed input is noticed without reading it."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append({"path": os.path.abspath(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def split_hash(key: str) -> float:
    """A stable number in [0, 1) per key: the document is in eval when it is < eval_fraction."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _decode(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _open(path: str) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_documents(
    files: Sequence[SourceFile],
    *,
    text_key: str = "text",
    txt_mode: TxtMode = "file",
    want: Callable[[str], bool] | None = None,
) -> Iterator[Document]:
    """Every document of the files in order; with `want`, only those whose key it accepts
    (the others are not decoded or parsed, so reading one split of a corpus is cheap)."""
    for f in files:
        try:
            if f.path.endswith((".jsonl", ".jsonl.gz")):
                yield from _jsonl(f, text_key, want)
            elif txt_mode == "blank_lines":
                yield from _blocks(f, want)
            elif want is None or want(f.key):
                with open(f.path, "rb") as fh:
                    yield Document(f.key, f.path, _decode(fh.read()))
        except (OSError, EOFError) as e:  # unreadable, or a corrupt/truncated .gz
            raise ValueError(f"{f.path}: cannot read: {e}") from None


def _jsonl(f: SourceFile, text_key: str, want: Callable[[str], bool] | None) -> Iterator[Document]:
    def text_of(record: Any, where: str) -> str:
        if not isinstance(record, dict) or text_key not in record:
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: no {text_key!r} field (--text_key); the line has {got}")
        text = record[text_key]
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: {text_key!r} is a {type(text).__name__}, not a string: {text!r:.80}"
            )
        return text

    return jsonl_documents(f, want, text_of)


def jsonl_documents(
    f: SourceFile, want: Callable[[str], bool] | None, text_of: Callable[[Any, str], str]
) -> Iterator[Document]:
    """One Document per non-blank line of a JSONL file (.gz streamed): key "<file key>:<line>",
    text = text_of(the line's JSON value, "path:line"), which raises ValueError for a record
    of the wrong shape. A line that is not valid JSON is a ValueError naming path:line; bytes
    that are not UTF-8, or a text with lone surrogates, give text=None. Lines whose key
    `want` rejects are not decoded or parsed."""
    with _open(f.path) as fh:
        for lineno, line in enumerate(fh, 1):
            key = f"{f.key}:{lineno}"
            if not line.strip() or (want is not None and not want(key)):
                continue
            where = f"{f.path}:{lineno}"
            decoded = _decode(line)
            if decoded is None:
                yield Document(key, where, None)
                continue
            try:
                record = json.loads(decoded)
            except ValueError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            text = text_of(record, where)
            # JSON escapes can spell lone surrogates ("\ud800"), which are not UTF-8 either.
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    yield Document(key, where, None)
                    continue
            yield Document(key, where, text)


def _blocks(f: SourceFile, want: Callable[[str], bool] | None) -> Iterator[Document]:
    """Blocks of lines separated by blank (whitespace-only) lines, without the separator."""
    block: list[bytes] = []
    index, first_line = 0, 1
    with open(f.path, "rb") as fh:
        for lineno, line in _numbered_lines(fh):
            if line.strip():
                if not block:
                    first_line = lineno
                block.append(line)
                continue
            if block:
                key = f"{f.key}#{index}"
                if want is None or want(key):
                    text = b"".join(block).removesuffix(b"\n").removesuffix(b"\r")
                    yield Document(key, f"{f.path}:{first_line}", _decode(text))
                block, index = [], index + 1


def _numbered_lines(fh: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every line, then one blank line that ends the last block."""
    lineno = 0
    for lineno, line in enumerate(fh, 1):  # noqa: B007  (lineno is read after the loop)
        yield lineno, line
    yield lineno + 1, b"\n"
