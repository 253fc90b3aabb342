"""Train a sentencepiece tokenizer on a bounded, deterministic sample of a prepared split.

The model round-trips any text (`decode(encode(x)) == x`, code included): byte fallback (a
character outside the vocabulary becomes its UTF-8 bytes), identity normalisation, no
whitespace folding. Ids: pad 0, unk 1, BOS 2, EOS 3.

sentencepiece trains on "sentences" and drops those longer than max_sentence_length, so
documents are fed as lines, long lines cut into chunks.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

ModelType = Literal["bpe", "unigram"]
SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
NUM_BYTE_PIECES = 256  # byte fallback: one piece per byte value
MIN_VOCAB_SIZE = NUM_BYTE_PIECES + len(SPECIAL_IDS) + 1
CHARACTER_COVERAGE = 0.9995  # the rarest 0.05% of characters are spelled as bytes
LINE_CHARS = 4096  # longer lines are cut: <= 4 UTF-8 bytes a character fits max_sentence_length
_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def sample_lines(source: Sequence[Any], max_chars: int, total_chars: int | None) -> Iterator[str]:
    """Non-blank lines of evenly spaced documents of `source` (records {"text": bytes}), until
    `max_chars` characters. Visits documents 0, s, 2s, ..., then 1, 1 + s, ... (stride s chosen
    from total_chars so the first sweep about fills the budget): deterministic, spread over the
    whole split (TFDS stores a split in an order shuffled by key hash)."""
    n = len(source)
    stride = 1
    if total_chars and total_chars > max_chars:
        docs_needed = math.ceil(n * max_chars / total_chars)
        stride = max(1, n // docs_needed)
    budget = max_chars
    for start in range(stride):
        for i in range(start, n, stride):
            text = _record_text(source[i])
            for line in text.split("\n"):
                for c in range(0, len(line), LINE_CHARS):
                    chunk = line[c : c + LINE_CHARS]
                    if not chunk.strip():
                        continue
                    chunk = chunk[:budget]
                    budget -= len(chunk)
                    yield chunk
                    if budget <= 0:
                        return


def _record_text(record: dict[str, Any]) -> str:
    """A prepared record's text: {"text"}, or a chat record's message contents, one a line."""
    if "text" in record:
        text = record["text"]
        return text.decode("utf-8") if isinstance(text, bytes) else str(text)
    raw = record["messages"]
    messages = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    return "\n".join(str(m.get("content") or "") for m in messages)


def train_sentencepiece(
    lines: Iterable[str],
    out_path: str,
    *,
    vocab_size: int,
    model_type: ModelType = "bpe",
    user_defined_symbols: Sequence[str] = (),
) -> str:
    """Trains on `lines` and writes the model to out_path (atomically). Raises ValueError
    naming the limit when vocab_size is too small or too large for the text.
    user_defined_symbols become single pieces wherever they appear (chat templates' tokens)."""
    import sentencepiece as spm

    counted = _Counted(lines)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(counted),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=CHARACTER_COVERAGE,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            hard_vocab_limit=True,
            max_sentence_length=4 * LINE_CHARS,  # bytes
            num_threads=os.cpu_count() or 1,
            minloglevel=2,  # errors only: sentencepiece logs every training step otherwise
            pad_id=SPECIAL_IDS["pad_id"],
            unk_id=SPECIAL_IDS["unk_id"],
            bos_id=SPECIAL_IDS["bos_id"],
            eos_id=SPECIAL_IDS["eos_id"],
            user_defined_symbols=list(user_defined_symbols),
        )
    except RuntimeError as e:
        if counted.error is not None:  # sentencepiece reports the iterator's own error vaguely
            raise counted.error from None
        raise _vocab_error(str(e), vocab_size, counted.chars) from None
    tmp = f"{out_path}.{os.getpid()}.tmp"  # beside it, so the rename is atomic
    try:
        with open(tmp, "wb") as f:
            f.write(model.getvalue())
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


class VocabSizeError(ValueError):
    """vocab_size does not fit the text; `limit` is the largest (too_large) or the smallest
    (not too_large) vocab_size that does."""

    def __init__(self, message: str, vocab_size: int, limit: int, too_large: bool):
        super().__init__(message)
        self.vocab_size, self.limit, self.too_large = vocab_size, limit, too_large


def _vocab_error(message: str, vocab_size: int, chars: int) -> ValueError:
    if m := _TOO_HIGH.search(message):
        limit = int(m.group(2))
        return VocabSizeError(
            f"vocab_size {vocab_size} is too large for this text: sentencepiece can make at "
            f"most {limit} pieces from the {chars:,} characters sampled; use --vocab_size "
            f"{limit} or less (or give more text / a larger --sample_chars)",
            vocab_size,
            limit,
            too_large=True,
        )
    if m := _TOO_LOW.search(message):
        need = int(m.group(2))
        kept = need - NUM_BYTE_PIECES - len(SPECIAL_IDS)
        return VocabSizeError(
            f"vocab_size {vocab_size} is too small for this text: the {NUM_BYTE_PIECES} byte "
            f"pieces, {len(SPECIAL_IDS)} special ids and the {kept} characters kept "
            f"(character_coverage {CHARACTER_COVERAGE}) need {need}; use --vocab_size {need} "
            f"or more",
            vocab_size,
            need,
            too_large=False,
        )
    last = message.strip().splitlines()[-1] if message.strip() else message
    return ValueError(f"sentencepiece could not train a {vocab_size}-piece tokenizer: {last}")


class _Counted:
    """Passes lines through, counting their characters and keeping the error (if any) the
    lines raised, for messages."""

    def __init__(self, lines: Iterable[str]):
        self._lines, self.chars = lines, 0
        self.error: Exception | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for line in self._lines:
                self.chars += len(line)
                yield line
        except Exception as e:
            self.error = e
            raise


def train_from_split(
    dataset_dir: str,
    out_path: str,
    *,
    vocab_size: int,
    model_type: ModelType = "bpe",
    sample_chars: int = 20_000_000,
    total_chars: int | None = None,
    split: str = "train",
    quiet: bool = False,
    user_defined_symbols: Sequence[str] = (),
) -> str:
    """A tokenizer trained on up to sample_chars characters of a prepared split."""
    import tensorflow_datasets as tfds

    source = tfds.builder_from_directory(dataset_dir).as_data_source(split)
    chars = min(sample_chars, total_chars) if total_chars else sample_chars
    if not quiet:
        print(
            f"prepare: training a {vocab_size}-piece {model_type} tokenizer on "
            f"{chars:,} characters of {split!r}",
            file=sys.stderr,
        )
    lines = sample_lines(source, sample_chars, total_chars)
    return train_sentencepiece(
        lines,
        out_path,
        vocab_size=vocab_size,
        model_type=model_type,
        user_defined_symbols=user_defined_symbols,
    )


__all__ = [
    "MIN_VOCAB_SIZE",
    "ModelType",
    "VocabSizeError",
    "sample_lines",
    "train_from_split",
    "train_sentencepiece",
]
