"""The decode step compiles ahead of time for a TPU topology (libtpu, no TPU)."""

from __future__ import annotations

from pathlib import Path

from moetext import config
from moetext.aot import compile_decode_step

REPO = Path(__file__).resolve().parents[2]


def test_tiny_decode_step_compiles_for_v5e_and_fits():
    cfg = config.load(REPO / "configs/models/tiny-qwen3-moe.yml")
    r = compile_decode_step(cfg, "v5e:2x2", batch=8, cache_len=256)
    assert r["chips"] == 4 and r["mesh"]["fsdp"] == 4 and r["fits"]
    # The KV caches (2 layers x k, v x [8, 256, 2, 16] float32 = 262144 bytes, sharded over
    # the batch) are donated: the outputs alias them.
    assert r["alias_bytes"] == 2 * 2 * 8 * 256 * 2 * 16 * 4 // 4
    assert r["xla_flops_per_chip"] > 0
