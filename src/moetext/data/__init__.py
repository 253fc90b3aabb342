"""Input pipelines: each process gets its own rows of every global batch, in step order.

`build(cfg, vocab_size, rows)` returns a `TrainData`: `next_batch()` gives the next batch's
rows `rows` (moetext.data.batch), `get_state()`/`set_state()` the exact position (saved per
process in every checkpoint), `eval_batches()` the fixed held-out batches. kind=tfds reads a
dataset prepared by `python -m moetext.data.prepare` (moetext.data.pipeline); kind=chat one
prepared with `--format chat` (moetext.data.chat_pipeline: conversations, a loss mask);
kind=synthetic is the seeded Markov stream the benchmarks use.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from etils import epath

from moetext.config import DataConfig
from moetext.data.batch import Batch
from moetext.data.synthetic import SyntheticData
from moetext.errors import ConfigError

if TYPE_CHECKING:
    from moetext.data.tokenizer import Tokenizer


class TrainData:
    """Batches (this process's rows) for training and evaluation, with a resumable position."""

    tokenizer: Tokenizer | None = None  # set for text data

    def next_batch(self) -> Batch:
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def restore(self, process_states: Sequence[dict[str, Any]]) -> None:
        """Resumes from the states every process saved (any number of processes)."""
        kinds = {s.get("kind") for s in process_states}
        if kinds != {self.get_state()["kind"]}:
            raise ConfigError(
                f"the checkpoint's data position is for data.kind={sorted(map(str, kinds))}, "
                f"this run reads data.kind={self.get_state()['kind']!r}"
            )
        merged: dict[str, Any] = {}
        for s in process_states:
            for k, v in s.items():
                if isinstance(v, dict):  # per-row positions: each process saved its rows
                    merged.setdefault(k, {}).update(v)
                elif merged.setdefault(k, v) != v:
                    raise ValueError(f"processes saved different data positions: {k}")
        self.set_state(merged)

    def eval_batches(self) -> list[Batch]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SyntheticTrainData(TrainData):
    """The synthetic stream; its position is the step."""

    def __init__(self, cfg: DataConfig, vocab_size: int, rows: Sequence[int]):
        self.data, self.rows, self.step = SyntheticData(cfg, vocab_size), np.asarray(rows), 0

    def next_batch(self) -> Batch:
        batch = self.data.batch(self.step)
        self.step += 1
        return {k: v[self.rows] for k, v in batch.items()}

    def get_state(self) -> dict[str, Any]:
        return {"kind": "synthetic", "step": self.step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def eval_batches(self) -> list[Batch]:
        batches = (self.data.batch(i, split="eval") for i in range(self.data.cfg.eval_batches))
        return [{k: v[self.rows] for k, v in b.items()} for b in batches]


class TextTrainData(TrainData):
    """Packed rows of a prepared TFDS dataset (see moetext.data.pipeline)."""

    tokenizer: Tokenizer

    def __init__(
        self, cfg: DataConfig, dataset_dir: str, tokenizer: Tokenizer, rows: Sequence[int]
    ):
        from moetext.data import pipeline

        self.cfg, self.dataset_dir, self.tokenizer, self.rows = cfg, dataset_dir, tokenizer, rows
        self._pipeline = pipeline
        docs = pipeline.tokenized_documents(
            pipeline.document_source(dataset_dir, cfg.train_split),
            tokenizer,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
        )
        packed = pipeline.PackedBatches(
            docs, rows=rows, global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len
        )
        self._train = pipeline.Prefetcher(packed, cfg.prefetch)
        self._eval: list[Batch] | None = None

    def next_batch(self) -> Batch:
        return next(self._train)

    def get_state(self) -> dict[str, Any]:
        return {"kind": "tfds", "rows": self._train.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._train.set_state(state["rows"])

    def eval_batches(self) -> list[Batch]:
        if self._eval is None:
            p, cfg = self._pipeline, self.cfg
            source = p.document_source(self.dataset_dir, cfg.eval_split)
            docs = p.tokenized_documents(source, self.tokenizer, seed=cfg.seed, shuffle=False)
            packed = p.PackedBatches(
                docs, rows=self.rows, global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len
            )
            self._eval = [next(packed) for _ in range(cfg.eval_batches)]
        return self._eval

    def close(self) -> None:
        self._train.close()


def build(cfg: DataConfig, vocab_size: int, rows: Sequence[int] | None = None) -> TrainData:
    """The data for rows `rows` of each global batch (all rows by default).

    Raises ConfigError for a dataset that is not prepared, a missing tokenizer, or a
    tokenizer with more pieces than the model's vocab_size (the trainer builds the data before
    it writes or compiles anything). The embedded corpus (data.name=python_docs) is prepared
    on first use instead.
    """
    rows = list(range(cfg.global_batch_size)) if rows is None else list(rows)
    if cfg.kind == "synthetic":
        return SyntheticTrainData(cfg, vocab_size, rows)
    if cfg.kind == "tfds":
        dataset_dir, tokenizer = resolve_tfds(cfg, vocab_size)
        return TextTrainData(cfg, dataset_dir, tokenizer, rows)
    if cfg.kind == "chat":
        from moetext.data import chat_pipeline

        return chat_pipeline.build(cfg, vocab_size, rows)
    raise ConfigError(f"unknown data.kind {cfg.kind!r}; valid: synthetic, tfds, chat")


def resolve_tfds(cfg: DataConfig, vocab_size: int) -> tuple[str, Tokenizer]:
    """(prepared dataset directory, loaded tokenizer), checked against the model; prepares the
    embedded python_docs corpus (and its tokenizer) when it is not there yet."""
    from moetext.data import corpus
    from moetext.data.tokenizer import find_tokenizer, load_tokenizer

    data_dir = os.path.expanduser(cfg.data_dir or corpus.default_data_dir())
    assert cfg.name, "validated by config"
    tokenizer_path: str | None
    if cfg.name == corpus.PYTHON_DOCS:
        # A run that brings its own tokenizer needs only the text.
        want_vocab = None if cfg.tokenizer else vocab_size
        dataset_dir, tokenizer_path = corpus.ensure_python_docs(data_dir, vocab_size=want_vocab)
    else:
        dataset_dir = _dataset_version_dir(data_dir, cfg.name)
        tokenizer_path = find_tokenizer(dataset_dir)
    tokenizer_path = cfg.tokenizer or tokenizer_path
    if tokenizer_path is None:
        raise ConfigError(
            f"no tokenizer beside the dataset {dataset_dir}: set data.tokenizer to a "
            f"sentencepiece .model or a Hugging Face tokenizer.json"
        )
    try:
        tokenizer = load_tokenizer(str(tokenizer_path))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer_path} has {tokenizer.vocab_size} pieces but "
            f"model.vocab_size={vocab_size}: raise model.vocab_size to at least "
            f"{tokenizer.vocab_size}, or prepare the data with --vocab_size <= {vocab_size}"
        )
    return dataset_dir, tokenizer


def _dataset_version_dir(data_dir: str, name: str) -> str:
    root = epath.Path(data_dir) / name
    versions = [
        v.name
        for v in (root.iterdir() if root.is_dir() else [])
        if (v / "dataset_info.json").exists()
    ]
    if not versions:
        raise ConfigError(
            f"data.name={name!r}: no such dataset under data.data_dir={data_dir!r} (no "
            f"{name}/<version>/dataset_info.json there); prepare it first: python -m "
            f"moetext.data.prepare --input 'path/to/corpus/*.jsonl' --name {name} "
            f"--data_dir {shlex.quote(data_dir)}"
        )
    newest = max(versions, key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))
    version_dir: str = os.fspath(root / newest)  # (etils.epath is untyped: Any)
    return version_dir


def save_tokenizer(data: TrainData, run_dir: str | os.PathLike[str]) -> None:
    """Copies the run's tokenizer into RUN_DIR/tokenizer so the run is self-contained."""
    if data.tokenizer is None:
        return
    target = epath.Path(run_dir) / "tokenizer"
    if target.exists():
        target.rmtree()
    data.tokenizer.save(os.fspath(target))


__all__ = ["Batch", "SyntheticData", "TrainData", "build", "resolve_tfds", "save_tokenizer"]
