"""The embedded corpus `python_docs`: real English + code text on any machine, no download.

Documents: the CPython documentation topics (`pydoc_data.topics`, one document per topic) and
the standard library's docstrings, read with `ast` from the running interpreter's stdlib
source files (never imported): one document per module, its docstring followed by the
docstrings of its classes and functions, each under its qualified name. The Python version is
the dataset's TFDS version, so each interpreter gets its own copy (DATA_DIR/python_docs/X.Y.Z/).

`ensure_python_docs` prepares the text once and a sentencepiece tokenizer per vocabulary size
(`tokenizer-v<V>.model` beside the dataset, V = min(requested, VOCAB_CAP), raised to the
corpus' minimum of ~350 pieces when below it). Its pieces include `<|im_start|>` and
`<|im_end|>` (user-defined symbols, as a released base model's tokenizer reserves its chat
tokens), so a model pretrained on it can be fine-tuned on conversations with the built-in
ChatML template (moetext.data.chat_template). The preparation runs under an exclusive file
lock so that concurrent first uses (pytest workers, processes on one filesystem) wait for a
single preparation.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moetext import paths
from moetext.data import prepare as prepare_lib
from moetext.data.chat_template import CHATML_TOKENS
from moetext.data.train_tokenizer import VocabSizeError, train_from_split

PYTHON_DOCS = "python_docs"
# Bump when the documents or the tokenizers change, so caches are rebuilt (2: the tokenizers
# reserve the ChatML pieces).
CORPUS_FORMAT = 2
VOCAB_CAP = 8192  # the corpus (~2M characters) supports BPE vocabularies up to ~40k
EVAL_FRACTION = 0.02  # ~10 held-out documents
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}
    | {"__pycache__"}
)
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_BLOCKS = (ast.If, ast.Try, ast.TryStar, ast.ExceptHandler, ast.With)


def default_data_dir() -> str:
    """$MOETEXT_DATA_DIR, else $XDG_CACHE_HOME/moetext/data, else ~/.cache/moetext/data."""
    return paths.user_cache_dir("MOETEXT_DATA_DIR", "data")


def python_version() -> str:
    return "{}.{}.{}".format(*sys.version_info[:3])


def topic_documents() -> Iterator[str]:
    """The documentation topics of `help()` (language reference sections), sorted by name."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].strip()


def module_document(source: bytes, module: str) -> str | None:
    """A module's docstrings as one document; None when it has none (or does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    parts = []
    if doc := ast.get_docstring(tree):
        parts.append(f"# {module}\n\n{doc}")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _DEFS):
                name = f"{prefix}{child.name}"
                if doc := ast.get_docstring(child):
                    parts.append(f"## {module}.{name}\n\n{doc}")
                if isinstance(child, ast.ClassDef):  # methods, nested classes
                    visit(child, f"{name}.")
            elif isinstance(child, _BLOCKS):  # definitions under if/try/with
                visit(child, prefix)

    visit(tree, "")
    return "\n\n".join(parts) if parts else None


def stdlib_documents(stdlib: str | None = None) -> Iterator[str]:
    """One document per stdlib module with docstrings, in sorted path order."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = Path(directory, f)
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if doc := module_document(path.read_bytes(), module):
                yield doc


def write_jsonl(path: str) -> int:
    """Writes the corpus to a JSONL file; returns the number of documents."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in (*topic_documents(), *stdlib_documents()):
            f.write(json.dumps({"text": doc}) + "\n")
            n += 1
    return n


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive flock on PATH: other processes (any host sharing a POSIX-lock-capable
    filesystem) block here until the holder is done."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_python_docs(
    data_dir: str | None = None, vocab_size: int | None = VOCAB_CAP
) -> tuple[str, str | None]:
    """(dataset dir, tokenizer path) of the embedded corpus, preparing what is missing.

    The tokenizer has min(vocab_size, VOCAB_CAP) pieces (fewer than a model's vocab_size is
    fine: the extra embedding rows are never used), or the corpus' minimum (~350) if more.
    vocab_size=None prepares only the text (a run that brings its own tokenizer).
    """
    if vocab_size is None:
        data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
        os.makedirs(data_dir, exist_ok=True)
        dataset_dir = os.path.join(data_dir, PYTHON_DOCS, python_version())
        if not _ready(dataset_dir):
            with _locked(os.path.join(data_dir, f".{PYTHON_DOCS}.lock")):
                if not _ready(dataset_dir):
                    _prepare_text(data_dir, python_version())
        return dataset_dir, None
    data_dir = os.path.abspath(os.path.expanduser(data_dir or default_data_dir()))
    os.makedirs(data_dir, exist_ok=True)
    vocab = min(vocab_size, VOCAB_CAP)
    version = python_version()
    dataset_dir = os.path.join(data_dir, PYTHON_DOCS, version)
    tokenizer = os.path.join(dataset_dir, f"tokenizer-v{vocab}.model")
    if _ready(dataset_dir) and os.path.exists(tokenizer):
        return dataset_dir, tokenizer  # the common case: no lock needed
    with _locked(os.path.join(data_dir, f".{PYTHON_DOCS}.lock")):
        # Another process may have finished while this one waited for the lock.
        need_text, need_tokenizer = not _ready(dataset_dir), not os.path.exists(tokenizer)
        if need_text or need_tokenizer:
            what = "the embedded corpus and " if need_text else ""
            print(
                f"moetext: preparing {what}a {vocab}-piece tokenizer for {PYTHON_DOCS} (Python "
                f"{version} docs and docstrings) in {dataset_dir}",
                file=sys.stderr,
            )
        if need_text:
            _prepare_text(data_dir, version)  # replaces an older copy, its tokenizers included
        if need_text or need_tokenizer:
            tokenizer = _train_tokenizer(dataset_dir, vocab)
    return dataset_dir, tokenizer


def _prepare_text(data_dir: str, version: str) -> None:
    with tempfile.TemporaryDirectory(prefix="moetext-python-docs-") as tmp:
        jsonl = os.path.join(tmp, f"{PYTHON_DOCS}.jsonl")
        write_jsonl(jsonl)
        # overwrite: replaces a copy from an older CORPUS_FORMAT (tokenizers included).
        prepare_lib.prepare(
            [jsonl], PYTHON_DOCS, data_dir, version=version, eval_fraction=EVAL_FRACTION,
            with_tokenizer=False, extra={"corpus_format": CORPUS_FORMAT},
            overwrite=True, quiet=True,
        )  # fmt: skip


def _train_tokenizer(dataset_dir: str, vocab: int) -> str:
    """tokenizer-v<vocab>.model; below the smallest vocabulary the corpus allows (~350: bytes,
    specials and its characters), the smallest one, so that a model whose vocab_size is too
    small fails on the tokenizer-size check, which names the number."""
    record = prepare_lib.read_record(dataset_dir) or {}
    chars = record.get("stats", {}).get("characters", {}).get("train")
    path = os.path.join(dataset_dir, f"tokenizer-v{vocab}.model")
    kw = dict(total_chars=chars, quiet=True, user_defined_symbols=CHATML_TOKENS)
    try:
        return train_from_split(dataset_dir, path, vocab_size=vocab, **kw)
    except VocabSizeError as e:
        if e.too_large:
            raise ValueError(f"{PYTHON_DOCS}: {e}") from None
        smallest = os.path.join(dataset_dir, f"tokenizer-v{e.limit}.model")
        if not os.path.exists(smallest):
            train_from_split(dataset_dir, smallest, vocab_size=e.limit, **kw)
        return smallest


def _ready(dataset_dir: str) -> bool:
    record = prepare_lib.read_record(dataset_dir)
    extra = (record or {}).get("options", {}).get("extra", {})
    return bool(extra.get("corpus_format") == CORPUS_FORMAT)
