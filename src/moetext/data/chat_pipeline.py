"""Packed rows of conversations with a loss mask: data.kind=chat.

A dataset prepared by `python -m moetext.data.prepare --format chat` holds each conversation's
messages. Each is rendered with the chat template (moetext.data.chat_template) and tokenized
on the fly, so the template and data.train_on can change without preparing again; the loss
mask marks each assistant turn's content and end-of-turn token (data.train_on=assistant) or
every token (all).

Packing never splits a conversation: row stream r (as in moetext.data.pipeline, documents
r, r + B, ... of a seeded order) places whole conversations while they fit in the row's
L = seq_len + 1 tokens and pads the rest (segment 0, loss 0); the next conversation starts the
next row. A conversation longer than L is cut after the last assistant turn that fits
(data.overlong=truncate; with none that fits it is dropped) or dropped (drop). Building the
data counts them over the whole train split, prints the counts, and fails on a template
error (naming the conversation's file:line) before anything compiles.

Legend: B global rows, L = S + 1 tokens per row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import grain
import numpy as np

from moetext.config import DataConfig
from moetext.data import TrainData, chat_source, pipeline
from moetext.data.batch import CHAT_KEYS, Batch
from moetext.data.chat_template import ChatTemplate, ChatTemplateError, encode
from moetext.errors import ConfigError

if TYPE_CHECKING:
    from moetext.data.tokenizer import Tokenizer

# A conversation ready to pack: int32 ids and loss mask [n], n <= L (n = 0: dropped).
Conversation = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class ChatEncoder:
    """messages -> (ids, mask) fitted to a row, or why it was cut or dropped."""

    template: ChatTemplate
    tokenizer: Tokenizer
    row_len: int
    train_on: str = "assistant"
    overlong: str = "truncate"

    def __call__(self, record: dict[str, Any]) -> tuple[Conversation, str]:
        """((ids, mask), "fits" | "truncated" | "dropped")."""
        messages, where = chat_source.read_messages(record)
        try:
            enc = encode(self.template, self.tokenizer, messages, train_on=self.train_on)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"conversation {where}: {e}") from None
        n, status = len(enc.ids), "fits"
        if n > self.row_len:
            fitting = [t for t in enc.turn_ends if t <= self.row_len]
            if self.overlong == "truncate" and fitting and any(enc.mask[: fitting[-1]]):
                n, status = fitting[-1], "truncated"
            else:
                n, status = 0, "dropped"
        ids = np.asarray(enc.ids[:n], np.int32)
        return (ids, np.asarray(enc.mask[:n], np.int32)), status


def conversations(
    source: Any, encoder: ChatEncoder, *, seed: int, shuffle: bool
) -> grain.MapDataset:
    """Index k -> the k-th conversation of the seeded order (epochs follow each other)."""
    if len(source) == 0:
        raise ValueError("the dataset split is empty: prepare it from more conversations")
    ds = grain.MapDataset.source(source)
    ds = ds.shuffle(seed=seed) if shuffle else ds.repeat()
    return ds.map(lambda record: encoder(record)[0])


def count_fits(source: Any, encoder: ChatEncoder) -> dict[str, int]:
    """How many conversations of the split fit, were truncated, were dropped (one pass)."""
    counts = {"fits": 0, "truncated": 0, "dropped": 0}
    for i in range(len(source)):
        counts[encoder(source[i])[1]] += 1
    return counts


class ChatRowStream:
    """Row r of every global batch: whole conversations r, r + B, ..., padded to L tokens."""

    def __init__(
        self, docs: Callable[[int], Conversation], row: int, num_rows: int, row_len: int, pad: int
    ):
        self._docs, self.row, self.num_rows, self.row_len = docs, row, num_rows, row_len
        self.pad, self.doc = pad, 0
        self._cached: tuple[int, Conversation] | None = None

    def _document(self, j: int) -> Conversation:
        if self._cached is None or self._cached[0] != j:
            self._cached = (j, self._docs(self.row + j * self.num_rows))
        return self._cached[1]

    def next_row(self) -> tuple[np.ndarray, ...]:
        """tokens, segment_ids, positions, loss_mask: int32 [L] each."""
        tokens_L = np.full(self.row_len, self.pad, np.int32)
        segment_L = np.zeros(self.row_len, np.int32)
        position_L = np.zeros(self.row_len, np.int32)
        mask_L = np.zeros(self.row_len, np.int32)
        fill, segment = 0, 0
        while True:  # ends: building the data checked that some conversation fits
            ids_T, m_T = self._document(self.doc)
            if len(ids_T) == 0:  # dropped (overlong)
                self.doc += 1
                continue
            if fill + len(ids_T) > self.row_len:
                break
            segment += 1
            end = fill + len(ids_T)
            tokens_L[fill:end], mask_L[fill:end] = ids_T, m_T
            segment_L[fill:end], position_L[fill:end] = segment, np.arange(len(ids_T))
            fill, self.doc = end, self.doc + 1
        return tokens_L, segment_L, position_L, mask_L

    def get_state(self) -> list[int]:
        return [self.doc, 0]  # [next conversation, offset]: never inside one

    def set_state(self, state: Sequence[int]) -> None:
        self.doc = int(state[0])


class PackedChatBatches(pipeline.PackedBatches):
    """The rows `rows` of each global batch of conversations, with their loss mask."""

    def __init__(
        self,
        docs: grain.MapDataset,
        *,
        rows: Sequence[int],
        global_batch_size: int,
        seq_len: int,
        pad: int,
    ):
        self.rows = list(rows)
        get = lambda k: docs[k]
        streams: list[Any] = [  # the RowStream interface: next_row, get_state, set_state
            ChatRowStream(get, r, global_batch_size, seq_len + 1, pad) for r in self.rows
        ]
        self._streams = streams

    def __next__(self) -> Batch:
        parts = [s.next_row() for s in self._streams]
        keys = CHAT_KEYS
        return {key: np.stack([p[i] for p in parts]) for i, key in enumerate(keys)}

    def __iter__(self) -> Self:
        return self


class ChatTrainData(TrainData):
    """Packed conversation rows of a prepared chat dataset (data.kind=chat)."""

    tokenizer: Tokenizer

    def __init__(
        self,
        cfg: DataConfig,
        dataset_dir: str,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        rows: Sequence[int],
    ):
        self.cfg, self.dataset_dir, self.tokenizer, self.rows = cfg, dataset_dir, tokenizer, rows
        self.encoder = ChatEncoder(template, tokenizer, cfg.seq_len + 1, cfg.train_on, cfg.overlong)
        source = _chat_source(dataset_dir, cfg.train_split)
        self.counts = count_fits(source, self.encoder)
        _report(self.counts, cfg, cfg.train_split)
        docs = conversations(source, self.encoder, seed=cfg.seed, shuffle=cfg.shuffle)
        self._train = pipeline.Prefetcher(self._packed(docs), cfg.prefetch)
        self._eval: list[Batch] | None = None

    def _packed(self, docs: grain.MapDataset) -> PackedChatBatches:
        return PackedChatBatches(
            docs,
            rows=self.rows,
            global_batch_size=self.cfg.global_batch_size,
            seq_len=self.cfg.seq_len,
            pad=self.tokenizer.pad_id,
        )

    def next_batch(self) -> Batch:
        return next(self._train)

    def get_state(self) -> dict[str, Any]:
        return {"kind": "chat", "rows": self._train.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._train.set_state(state["rows"])

    def eval_batches(self) -> list[Batch]:
        if self._eval is None:
            source = _chat_source(self.dataset_dir, self.cfg.eval_split)
            _report(count_fits(source, self.encoder), self.cfg, self.cfg.eval_split)
            docs = conversations(source, self.encoder, seed=self.cfg.seed, shuffle=False)
            packed = self._packed(docs)
            self._eval = [next(packed) for _ in range(self.cfg.eval_batches)]
        return self._eval

    def close(self) -> None:
        self._train.close()


def _chat_source(dataset_dir: str, split: str) -> Any:
    source = pipeline.document_source(dataset_dir, split)
    if len(source) and "messages" not in source[0]:
        raise ConfigError(
            f"data.kind=chat: the dataset {dataset_dir} holds text documents, not conversations: "
            f"prepare the chat files with `python -m moetext.data.prepare --format chat`, or "
            f"train on it with data.kind=tfds"
        )
    return source


def _report(counts: dict[str, int], cfg: DataConfig, split: str) -> None:
    total = sum(counts.values())
    if counts["fits"] + counts["truncated"] == 0:
        raise ConfigError(
            f"data.kind=chat: none of the {total} conversations of {split!r} fits in "
            f"data.seq_len + 1 = {cfg.seq_len + 1} tokens (data.overlong={cfg.overlong}): "
            f"raise data.seq_len"
        )
    if counts["truncated"] or counts["dropped"]:
        print(
            f"data: {total} conversations in {split!r}: {counts['truncated']} "
            f"longer than data.seq_len + 1 = {cfg.seq_len + 1} tokens cut after their last "
            f"assistant turn that fits, {counts['dropped']} dropped "
            f"(data.overlong={cfg.overlong})",
            file=sys.stderr,
        )


def build(cfg: DataConfig, vocab_size: int, rows: Sequence[int]) -> ChatTrainData:
    """data.kind=chat: the prepared dataset, its tokenizer and the chat template; a template
    that cannot be loaded or raises on a conversation is a ConfigError before compiling."""
    from moetext.data import resolve_tfds
    from moetext.data.chat_template import load_chat_template

    dataset_dir, tokenizer = resolve_tfds(cfg, vocab_size)
    _chat_source(dataset_dir, cfg.train_split)  # a text dataset: say so before the template
    try:
        template = load_chat_template(tokenizer, cfg.chat_template)
        return ChatTrainData(cfg, dataset_dir, tokenizer, template, rows)
    except ChatTemplateError as e:
        raise ConfigError(str(e)) from None
