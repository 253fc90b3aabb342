"""Packed rows from a prepared TFDS dataset: grain source -> shuffle -> tokenize -> pack.

The global batch is B independent row streams (B = data.global_batch_size). Stream r reads
documents r, r + B, r + 2B, ... of the split in a seeded order that is reshuffled every
epoch (grain's index shuffle over the array_record source: random access, no shuffle buffer;
with data.shuffle=false, and for evaluation, in stored order, repeated), tokenizes each one
on the fly as [BOS] + text + [EOS] (no BOS when the tokenizer defines none), and cuts the
concatenation into rows of S + 1 tokens.
A document that does not fit in the rest of a row continues at the start of the stream's
next row, its positions counting on, so no token is ever dropped or padded.

So row r at step n depends only on (dataset, seed, r, n): a process that owns rows i..j runs
streams i..j and nothing else, and packing does not depend on the number of processes. A
stream's whole state is two integers (the next document's index and the offset into it), so
a checkpoint restores the exact position.

Legend: B global rows, L = S + 1 tokens per row.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import grain
import numpy as np

from moetext.data.batch import Batch

if TYPE_CHECKING:
    from moetext.data.tokenizer import Tokenizer


def document_source(dataset_dir: str, split: str) -> Any:
    """The split as a random-access source of {"text": bytes} (array_record via TFDS)."""
    import tensorflow_datasets as tfds

    # builder_from_directory reads what `prepare` wrote; it never consults the TFDS catalog,
    # so a dataset name like "c4" cannot trigger a download.
    builder = tfds.builder_from_directory(dataset_dir)
    if split not in builder.info.splits:
        raise ValueError(
            f"dataset {dataset_dir} has no split {split!r}; it has {sorted(builder.info.splits)}"
        )
    return builder.as_data_source(split)


def tokenized_documents(
    source: Any, tokenizer: Tokenizer, *, seed: int, shuffle: bool
) -> grain.MapDataset:
    """Index k -> int32 token ids of a document; epochs follow each other as k grows."""
    if len(source) == 0:
        raise ValueError("the dataset split is empty: prepare it from more documents")
    ds = grain.MapDataset.source(source)
    if shuffle:
        # Indices past len(source) fall in later epochs, each with its own permutation.
        ds = ds.shuffle(seed=seed)
    else:
        ds = ds.repeat()
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    suffix = [tokenizer.eos_id]

    def encode(doc: dict[str, Any]) -> np.ndarray:
        text = doc["text"]
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        return np.asarray(prefix + tokenizer.encode(text) + suffix, np.int32)

    return ds.map(encode)


class RowStream:
    """Row r of every global batch: documents r, r + B, ... packed into rows of L tokens."""

    def __init__(self, docs: Callable[[int], np.ndarray], row: int, num_rows: int, row_len: int):
        self._docs, self.row, self.num_rows, self.row_len = docs, row, num_rows, row_len
        self.doc = 0  # this stream's next document (global index row + doc * num_rows)
        self.offset = 0  # tokens of that document already emitted
        self._cached: tuple[int, np.ndarray] | None = None

    def _document(self, j: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != j:
            self._cached = (j, self._docs(self.row + j * self.num_rows))
        return self._cached[1]

    def next_row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens, segment_ids, positions: int32 [L] each."""
        tokens_L = np.empty(self.row_len, np.int32)
        segment_L = np.empty(self.row_len, np.int32)
        position_L = np.empty(self.row_len, np.int32)
        fill, segment = 0, 0
        while fill < self.row_len:
            doc_T = self._document(self.doc)
            take = min(self.row_len - fill, len(doc_T) - self.offset)
            segment += 1
            tokens_L[fill : fill + take] = doc_T[self.offset : self.offset + take]
            segment_L[fill : fill + take] = segment
            position_L[fill : fill + take] = np.arange(self.offset, self.offset + take)
            fill += take
            self.offset += take
            if self.offset == len(doc_T):
                self.doc, self.offset = self.doc + 1, 0
        return tokens_L, segment_L, position_L

    def get_state(self) -> list[int]:
        return [self.doc, self.offset]

    def set_state(self, state: Sequence[int]) -> None:
        self.doc, self.offset = int(state[0]), int(state[1])


class PackedBatches:
    """The rows `rows` of each global batch, in step order; state is exact and tiny."""

    def __init__(
        self,
        docs: grain.MapDataset,
        *,
        rows: Sequence[int],
        global_batch_size: int,
        seq_len: int,
    ):
        self.rows = list(rows)
        get = lambda k: docs[k]
        self._streams = [RowStream(get, r, global_batch_size, seq_len + 1) for r in self.rows]

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Batch:
        parts = [s.next_row() for s in self._streams]
        return {
            key: np.stack([p[i] for p in parts])
            for i, key in enumerate(("tokens", "segment_ids", "positions"))
        }

    def get_state(self) -> dict[str, list[int]]:
        return {str(s.row): s.get_state() for s in self._streams}

    def set_state(self, state: dict[str, Sequence[int]]) -> None:
        missing = [r for r in self.rows if str(r) not in state]
        if missing:
            raise ValueError(
                f"the saved data state has no position for rows {missing[:8]}: it was saved "
                f"with another data.global_batch_size or process layout"
            )
        for s in self._streams:
            s.set_state(state[str(s.row)])


# What the prefetch thread hands over: (batch, the state after it), or the source's exception.
_Item = tuple[Batch, dict[str, Any]] | Exception


class Prefetcher:
    """Prepares the next `depth` batches in a background thread while the step runs.

    get_state() is the state after the last batch handed out, not after the read-ahead, so a
    checkpoint taken after step n resumes with batch n + 1.
    """

    def __init__(self, source: PackedBatches, depth: int):
        self._source, self._depth = source, max(int(depth), 1)
        self._state: dict[str, Any] = source.get_state()
        self._queue: queue.Queue[_Item] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._queue = queue.Queue(self._depth)
        self._stop.clear()
        self._thread = threading.Thread(target=self._fill, name="moetext-data", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                item: _Item = (next(self._source), self._source.get_state())
            except Exception as e:  # handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        batch, self._state = item
        return batch

    def get_state(self) -> dict[str, Any]:
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        self.close()
        self._source.set_state(state)
        self._state = self._source.get_state()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
