"""Input pipelines: global batches, indexed by step, sharded over the data axes."""

from __future__ import annotations

from moetext.config import DataConfig
from moetext.data.synthetic import SyntheticData


def build(cfg: DataConfig, vocab_size: int) -> SyntheticData:
    if cfg.kind == "synthetic":
        return SyntheticData(cfg, vocab_size)
    raise ValueError(f"unknown data.kind {cfg.kind!r}; valid: synthetic")


__all__ = ["SyntheticData", "build"]
