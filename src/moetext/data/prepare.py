"""Local text files -> a TFDS dataset (array_record, splits train/eval) + a tokenizer beside it.

    python -m moetext.data.prepare --input 'corpus/*.jsonl' --name my_corpus --data_dir DIR
    python -m moetext.data.prepare --format chat --input 'chats/*.jsonl' --name my_chats ...

Writes DATA_DIR/NAME/VERSION/: the TFDS files, the tokenizer (`tokenizer.model`, or the
`--tokenizer` given: `tokenizer.json` + `tokenizer_config.json` for Hugging Face) and
`moetext_prepare.json` (the inputs' fingerprint: paths, sizes, mtimes; every option; counts).

- Inputs (moetext.data.sources): .txt, .jsonl, .jsonl.gz files, directories, globs; streamed.
  --format chat: .jsonl(.gz) conversations (moetext.data.chat_source), stored as the JSON of
  their messages (feature `messages`, with `source` = file:line); a tokenizer trained for them
  has <|im_start|> and <|im_end|> as single pieces (the built-in ChatML template's tokens);
  a --tokenizer given for them must have a chat template of its own or those pieces.
- Split: a document is in `eval` when a hash of its key (file + line/block) is below
  eval_fraction. Tiny corpora: if that leaves eval empty (eval_fraction > 0, >= 2 documents)
  the train document with the smallest hash moves there, and if it leaves train empty the
  eval document with the largest hash moves back. eval_fraction=0: no eval split.
- Skipped and counted, with a warning: documents whose bytes are not valid UTF-8 (including
  JSON-escaped lone surrogates), and empty (whitespace-only) documents.
- Errors (ValueError / FileNotFoundError, raised before anything is written): a missing input,
  an unsupported file type, a JSONL line that is not JSON or lacks the text field, no
  documents. A vocab_size too small or too large for the corpus is found when the tokenizer
  trains, on the staged copy, which is then removed: nothing is left behind.
- Re-running with the same inputs and options does nothing (with overwrite too). Other inputs
  or options over an existing dataset: an error unless overwrite. Every build goes to a hidden
  staging dir in DATA_DIR and is renamed into place at the end, so a failed or interrupted
  run never leaves a half-written dataset where a complete one was (a process killed -9 can
  leave a `.NAME-VERSION.staging-*` dir behind, nothing else).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from moetext import paths
from moetext.data import chat_source, sources, tfds_text
from moetext.data.chat_template import CHATML_TOKENS, ChatTemplateError, load_chat_template
from moetext.data.sources import SourceFile, TxtMode
from moetext.data.tokenizer import (
    CHAT_TEMPLATE_FILE,
    HF_CONFIG_FILE,
    SENTENCEPIECE_FILE,
    Tokenizer,
    load_tokenizer,
)
from moetext.data.train_tokenizer import MIN_VOCAB_SIZE, ModelType, train_from_split

RECORD_FILE = "moetext_prepare.json"
RECORD_FORMAT = 1
DEFAULT_VERSION = "1.0.0"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")  # TFDS uses it in file names
Format = Literal["text", "chat"]
# want(key) -> bool, or None for all -> the documents of the inputs, in order.
Reader = Callable[[Callable[[str], bool] | None], Iterator[sources.Document]]


@dataclass(frozen=True)
class PrepareStats:
    documents: dict[str, int]  # per split
    characters: dict[str, int]  # per split (code points)
    skipped_invalid_utf8: int
    skipped_empty: int


@dataclass(frozen=True)
class PrepareResult:
    dataset_dir: str  # DATA_DIR/NAME/VERSION
    tokenizer_path: str | None
    stats: PrepareStats
    prepared: bool  # False: an identical preparation was already there


@dataclass
class _Scan:
    """The pre-pass over the corpus: counts per split, and the few documents placed against
    the hash rule (`overrides`) so that neither split is empty."""

    eval_fraction: float
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)
    documents: dict[str, int] = dataclasses.field(default_factory=lambda: {"train": 0, "eval": 0})
    characters: dict[str, int] = dataclasses.field(default_factory=lambda: {"train": 0, "eval": 0})
    invalid: int = 0
    first_invalid: str | None = None
    empty: int = 0

    def split_of(self, key: str) -> str:
        if key in self.overrides:
            return self.overrides[key]
        return "eval" if sources.split_hash(key) < self.eval_fraction else "train"

    def stats(self) -> PrepareStats:
        return PrepareStats(dict(self.documents), dict(self.characters), self.invalid, self.empty)


def _reader(files: Sequence[SourceFile], opt: Mapping[str, Any]) -> Reader:
    if opt.get("format") == "chat":
        return lambda want: chat_source.iter_conversations(files, want=want)
    key, mode = opt["text_key"], opt["txt_mode"]
    return lambda want: sources.iter_documents(files, text_key=key, txt_mode=mode, want=want)


def _scan(read: Reader, eval_fraction: float) -> _Scan:
    scan = _Scan(eval_fraction)
    lowest: tuple[float, str, int] | None = None  # (hash, key, characters) of train docs
    highest: tuple[float, str, int] | None = None  # of eval docs
    for doc in read(None):
        if doc.text is None:
            scan.invalid += 1
            scan.first_invalid = scan.first_invalid or doc.where
            continue
        if not doc.text.strip():
            scan.empty += 1
            continue
        h, split = sources.split_hash(doc.key), scan.split_of(doc.key)
        scan.documents[split] += 1
        scan.characters[split] += len(doc.text)
        if split == "train" and (lowest is None or h < lowest[0]):
            lowest = (h, doc.key, len(doc.text))
        if split == "eval" and (highest is None or h > highest[0]):
            highest = (h, doc.key, len(doc.text))
    total = scan.documents["train"] + scan.documents["eval"]
    # Small corpora: keep both splits non-empty when the hash rule leaves one empty.
    if eval_fraction > 0 and scan.documents["eval"] == 0 and lowest and total >= 2:
        scan.overrides[lowest[1]] = "eval"
        _move(scan, lowest[2], "train", "eval")
    if scan.documents["train"] == 0 and highest:
        scan.overrides[highest[1]] = "train"
        _move(scan, highest[2], "eval", "train")
    return scan


def _move(scan: _Scan, chars: int, src: str, dst: str) -> None:
    scan.documents[src] -= 1
    scan.documents[dst] += 1
    scan.characters[src] -= chars
    scan.characters[dst] += chars


def _record(
    files: Sequence[SourceFile], tokenizer_files: Sequence[str], options: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "format": RECORD_FORMAT,
        "inputs": sources.fingerprint([f.path for f in files]),
        "tokenizer_files": sources.fingerprint(tokenizer_files),
        "options": dict(options),
    }


def read_record(dataset_dir: str) -> dict[str, Any] | None:
    """The moetext_prepare.json of a prepared dataset, or None."""
    try:
        with open(os.path.join(dataset_dir, RECORD_FILE), encoding="utf-8") as f:
            record: dict[str, Any] = json.load(f)
            return record
    except (OSError, ValueError):
        return None


def _difference(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    if old is None:
        return f"no {RECORD_FILE}, so not by moetext.data.prepare or incomplete"
    diffs = [
        f"{k}={old['options'].get(k)!r} (now {v!r})"
        for k, v in new["options"].items()
        if old.get("options", {}).get(k) != v
    ]
    if old.get("inputs") != new["inputs"]:
        before = {(i["path"], i["size"], i["mtime_ns"]) for i in old.get("inputs", [])}
        changed = sum((i["path"], i["size"], i["mtime_ns"]) not in before for i in new["inputs"])
        diffs.append(f"other inputs ({changed} of {len(new['inputs'])} files new or changed)")
    if old.get("tokenizer_files") != new["tokenizer_files"]:
        diffs.append("another --tokenizer file")
    return "other options or inputs: " + ("; ".join(diffs) or "older record format")


def prepare(
    inputs: Sequence[str],
    name: str,
    data_dir: str,
    *,
    text_key: str = "text",
    txt_mode: TxtMode = "file",
    eval_fraction: float = 0.005,
    vocab_size: int = 8000,
    model_type: ModelType = "bpe",
    tokenizer: str | None = None,
    sample_chars: int = 20_000_000,
    overwrite: bool = False,
    version: str = DEFAULT_VERSION,
    with_tokenizer: bool = True,
    extra: Mapping[str, Any] | None = None,
    quiet: bool = False,
    format: Format = "text",
) -> PrepareResult:
    """Prepares DATA_DIR/NAME/VERSION from the inputs (see the module docstring).

    with_tokenizer=False writes no tokenizer (moetext.data.corpus trains its own per vocab
    size); `extra` is recorded with the options (a change counts as other options); quiet
    silences TFDS's progress output; format="chat" reads conversations (module docstring).
    """
    _check_options(name, version, txt_mode, eval_fraction, vocab_size, model_type, sample_chars)
    if format not in ("text", "chat"):
        raise ValueError(f"--format {format!r}: expected text or chat")
    files = sources.resolve_inputs(inputs)
    if format == "chat":
        chat_source.check_files(files)
    given = load_tokenizer(tokenizer) if tokenizer and with_tokenizer else None
    if format == "chat" and given is not None:
        _check_chat_tokenizer(given)
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    options = {
        "name": name,
        "version": version,
        "text_key": text_key,
        "txt_mode": txt_mode,
        "eval_fraction": eval_fraction,
        "vocab_size": vocab_size,
        "model_type": model_type,
        "tokenizer": os.path.abspath(tokenizer) if given and tokenizer else None,
        "sample_chars": sample_chars,
        "with_tokenizer": with_tokenizer,
        "extra": dict(extra or {}),
        # Only chat datasets record it: text datasets prepared before it existed stay current.
        **({"format": format} if format == "chat" else {}),
    }
    record = _record(files, given.files if given else [], options)
    final = os.path.join(data_dir, name, version)
    old = read_record(final)
    if old is not None and all(old.get(k) == v for k, v in record.items()):
        tok_path = old.get("tokenizer")
        if not quiet:
            print(f"prepare: {final} is already prepared from these inputs; nothing to do")
        return PrepareResult(
            final, os.path.join(final, tok_path) if tok_path else None, _stats(old), False
        )
    if os.path.exists(final) and not overwrite:
        raise ValueError(
            f"{final} already holds a dataset prepared with {_difference(old, record)}; "
            f"pass --overwrite to replace it, or choose another --name or --data_dir"
        )
    scan = _scan(_reader(files, options), eval_fraction)
    _check_scan(scan, files)
    if scan.invalid:
        print(
            f"prepare: warning: skipping {scan.invalid} documents that are not valid UTF-8 "
            f"(first: {scan.first_invalid})",
            file=sys.stderr,
        )
    return _build(files, scan, record, final, given, quiet=quiet)


def _build(
    files: Sequence[SourceFile],
    scan: _Scan,
    record: dict[str, Any],
    final: str,
    given: Tokenizer | None,
    *,
    quiet: bool,
) -> PrepareResult:
    """Builds into a hidden staging dir beside the dataset, then swaps it in."""
    opt = record["options"]
    data_dir = os.path.dirname(os.path.dirname(final))
    created = [d for d in (data_dir, os.path.dirname(final)) if not os.path.exists(d)]
    os.makedirs(data_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{opt['name']}-{opt['version']}.staging-", dir=data_dir)
    if not quiet:
        docs = scan.documents
        print(f"prepare: writing {docs['train']:,} train + {docs['eval']:,} eval documents")
    try:
        splits = [s for s in ("train", "eval") if scan.documents[s]]
        chat = opt.get("format") == "chat"
        generate = _split_documents(_reader(files, opt), scan, chat)
        built = tfds_text.write(
            staging, opt["name"], opt["version"], splits, generate, quiet=quiet,
            features=("messages", "source") if chat else ("text",),
        )  # fmt: skip
        tok_name = _add_tokenizer(built, given, opt, scan.characters["train"], quiet)
        stats = scan.stats()
        record = {**record, "stats": dataclasses.asdict(stats), "tokenizer": tok_name}
        with open(os.path.join(built, RECORD_FILE), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        _swap_in(built, final, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for d in reversed(created):  # remove directories this call made, if left empty
            with contextlib.suppress(OSError):
                os.rmdir(d)
    if not quiet:
        _report(final, stats, tok_name)
    return PrepareResult(final, os.path.join(final, tok_name) if tok_name else None, stats, True)


def _check_chat_tokenizer(tok: Tokenizer) -> None:
    """A --tokenizer for chat data needs a chat template it can render: its own (a
    chat_template.jinja or tokenizer_config.json's chat_template beside it), or the built-in
    ChatML one, whose <|im_start|> and <|im_end|> must then be single pieces. Checked now, not
    when training starts on a dataset prepared for nothing."""
    try:
        load_chat_template(tok)
    except ChatTemplateError as e:
        missing = [t for t in CHATML_TOKENS if tok.token_id(t) is None]
        if not missing:
            raise ValueError(f"--tokenizer {tok.path}: {e}") from None
        raise ValueError(
            f"--tokenizer {tok.path} lacks the pieces {', '.join(missing)} that the built-in "
            f"ChatML chat template needs as single tokens, and has no chat template of its own "
            f"({CHAT_TEMPLATE_FILE} or chat_template in {HF_CONFIG_FILE} beside it): leave out "
            f"--tokenizer to train one that has them (--vocab_size N), train yours with them "
            f"as user-defined symbols, or put a {CHAT_TEMPLATE_FILE} written for its pieces "
            f"beside it (data.chat_template then overrides it in training)"
        ) from None


def _split_documents(read: Reader, scan: _Scan, chat: bool) -> tfds_text.Generate:
    """split -> (key, text) of its documents (the others are not parsed)."""

    def generate(split: str) -> Iterator[tuple[str, str | dict[str, str]]]:
        def want(key: str) -> bool:
            return scan.split_of(key) == split

        for doc in read(want):
            if doc.text is not None and doc.text.strip():
                yield doc.key, {"messages": doc.text, "source": doc.where} if chat else doc.text

    return generate


def _add_tokenizer(
    built: str, given: Tokenizer | None, opt: dict[str, Any], train_chars: int, quiet: bool
) -> str | None:
    """Copies the given tokenizer into the dataset dir, or trains one; returns its file name."""
    if given is not None:
        return os.path.basename(given.save(built))
    if not opt["with_tokenizer"]:
        return None
    train_from_split(
        built,
        os.path.join(built, SENTENCEPIECE_FILE),
        vocab_size=opt["vocab_size"],
        model_type=opt["model_type"],
        sample_chars=opt["sample_chars"],
        total_chars=train_chars,
        quiet=quiet,
        user_defined_symbols=CHATML_TOKENS if opt.get("format") == "chat" else (),
    )
    return SENTENCEPIECE_FILE


def _swap_in(built: str, final: str, staging: str) -> None:
    """Moves the built version dir to `final`; an old one goes into staging (then deleted)."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    old = os.path.join(staging, "replaced")
    if os.path.exists(final):
        os.rename(final, old)
    try:
        os.rename(built, final)
    except OSError:
        if os.path.exists(old):
            os.rename(old, final)
        raise


def _report(final: str, stats: PrepareStats, tok_name: str | None) -> None:
    docs, chars = stats.documents, stats.characters
    print(
        f"prepare: wrote {final} ({docs['train']:,} train + {docs['eval']:,} eval documents, "
        f"{chars['train'] + chars['eval']:,} characters; skipped {stats.skipped_empty} empty, "
        f"{stats.skipped_invalid_utf8} not UTF-8)"
        + (f"; tokenizer: {tok_name}" if tok_name else "")
    )


def _stats(record: dict[str, Any]) -> PrepareStats:
    return PrepareStats(**record["stats"])


def _check_options(
    name: str,
    version: str,
    txt_mode: str,
    eval_fraction: float,
    vocab_size: int,
    model_type: str,
    sample_chars: int,
) -> None:
    if not _NAME.match(name):
        raise ValueError(f"--name {name!r}: use letters, digits and _, starting with a letter")
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise ValueError(f"version {version!r}: expected MAJOR.MINOR.PATCH, e.g. 1.0.0")
    if txt_mode not in ("file", "blank_lines"):
        raise ValueError(f"--txt_mode {txt_mode!r}: expected file or blank_lines")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"--eval_fraction {eval_fraction}: expected 0 <= eval_fraction < 1")
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model_type {model_type!r}: expected bpe or unigram")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"--vocab_size {vocab_size} is too small: byte fallback needs 256 byte pieces + 4 "
            f"special ids + the characters kept, so at least {MIN_VOCAB_SIZE}"
        )
    if sample_chars <= 0:
        raise ValueError(f"--sample_chars {sample_chars}: expected a positive number")


def _check_scan(scan: _Scan, files: Sequence[SourceFile]) -> None:
    if scan.documents["train"] + scan.documents["eval"] == 0:
        more = f" and {len(files) - 1} more" if len(files) > 1 else ""
        raise ValueError(
            f"no documents found in {files[0].path}{more}: {scan.empty} empty, "
            f"{scan.invalid} not valid UTF-8"
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moetext.data.prepare",
        description="Prepare local text files as a TFDS dataset plus a tokenizer.",
    )
    p.add_argument("--input", action="append", required=True, help="file, directory or glob")
    p.add_argument(
        "--format", choices=["text", "chat"], default="text",
        help="text documents, or chat conversations (JSONL messages or prompt/completion)",
    )  # fmt: skip
    p.add_argument("--name", required=True, help="dataset name (letters, digits, _)")
    p.add_argument("--data_dir", required=True, help="written to DATA_DIR/NAME/1.0.0/")
    p.add_argument("--text_key", default="text", help="JSONL field holding the text")
    p.add_argument("--txt_mode", choices=["file", "blank_lines"], default="file")
    p.add_argument("--eval_fraction", type=float, default=0.005)
    p.add_argument("--vocab_size", type=int, default=8000)
    p.add_argument("--model_type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--tokenizer", help="use this tokenizer (.model, tokenizer.json or its dir)")
    p.add_argument("--sample_chars", type=int, default=20_000_000)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        # Absolute at the boundary (~ expanded: the shell does not in --flag=~/x); --input
        # globs are sources.resolve_inputs'.
        a.data_dir = os.fspath(paths.writable_dir(a.data_dir, "--data_dir"))
        if a.tokenizer is not None:
            a.tokenizer = os.fspath(paths.existing(a.tokenizer, "--tokenizer"))
        prepare(
            a.input, a.name, a.data_dir, text_key=a.text_key, txt_mode=a.txt_mode,
            eval_fraction=a.eval_fraction, vocab_size=a.vocab_size, model_type=a.model_type,
            tokenizer=a.tokenizer, sample_chars=a.sample_chars, overwrite=a.overwrite,
            format=a.format,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
