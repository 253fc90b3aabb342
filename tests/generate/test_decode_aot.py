"""The decode step compiles ahead of time for a TPU topology (libtpu, no TPU)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

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


def _param_bytes(cfg: config.Config) -> int:
    """Bytes of the model's params at param_dtype (abstract: nothing is allocated)."""
    from flax import nnx

    from moetext import models

    abstract = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    return sum(x.size * x.dtype.itemsize for x in leaves)


# end_to_end/tpu/qwen3-30b-a3b/decode_aot.sh: the step decode.sh runs (bf16 params, fsdp, a
# 4096-slot cache) at batch 8 fits v5e:2x4 (7.54 of 16 GiB per chip) and v6e:2x2 (15.01 of 32).
# ~15-20 s per topology on 2 shared CPU cores (compile 15-16 s measured under load).
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, chips", [("v5e:2x4", 8), ("v6e:2x2", 4)])
def test_qwen3_30b_decode_step_fits(topology, chips):
    cfg = config.load(
        REPO / "configs/models/qwen3-30b-a3b.yml",
        ["model.param_dtype=bfloat16", "sharding.preset=fsdp"],
    )
    batch, cache_len = 8, 4096
    r = compile_decode_step(cfg, topology, batch=batch, cache_len=cache_len)
    assert r["chips"] == chips and r["mesh"]["fsdp"] == chips and r["fits"], r
    m = cfg.model
    cache = m.num_layers * 2 * batch * cache_len * m.num_kv_heads * m.head_dim * 2  # k, v bf16
    # The donated caches (split over the batch) are what the outputs alias, exactly.
    assert r["alias_bytes"] == cache // chips
    # Every weight is split over the chips (fsdp): arguments are the params' share plus the
    # caches', not a replicated copy (the norms, replicated, are ~1 MB).
    params = _param_bytes(cfg)
    assert params > 60e9  # ~30.5B bf16
    per_chip = params / chips + cache / chips
    assert per_chip <= r["arguments_bytes"] <= per_chip * 1.001 + 2**20, r


# The tiny config's experts widened to F = 128: Mosaic's gate and up blocks are 128 lanes wide.
WIDE = ["moe.moe_intermediate_size=128"]


@pytest.mark.tpu_aot
@pytest.mark.parametrize(
    "overrides, fused",
    [
        (["sharding.preset=fsdp_ep", "sharding.mesh.expert=4", *WIDE], True),
        (["sharding.preset=fsdp", *WIDE], True),
        (["sharding.preset=fsdp_tp", "sharding.mesh.tensor=2", *WIDE], False),
        (["sharding.preset=fsdp_ep", "sharding.mesh.expert=4"], False),
    ],
    ids=["fsdp_ep-fused", "fsdp-fused", "fsdp_tp-loop", "F64-loop"],
)
def test_auto_decodes_through_the_fused_kernel_where_it_can(overrides, fused):
    # kernels.decode_moe=auto on TPU: the Mosaic kernels in shard_map when the rules split the
    # expert weights along E (fsdp_ep) or D (fsdp) and F is a multiple of 128; else the loop
    # path (fsdp_tp splits F over `tensor`; the tiny config's F = 64).
    from moetext import aot, hlo, step_cost

    cfg = config.load(REPO / "configs/models/tiny-qwen3-moe.yml", overrides)
    r, compiled = aot.compiled_decode_step(cfg, "v5e:2x2", batch=8, cache_len=256)
    text = aot.hlo_text(compiled)
    assert (
        r["decode_moe"] == "auto" and step_cost.decode_step_cost(r, text)["hbm_bytes_accessed"] > 0
    )
    assert ("moetext_fused_" in text) == fused
    # The kernels read their expert weights through their own DMAs from HBM: XLA must not
    # stage a weight shard in VMEM (S(1)) before them, which it did for these small shards
    # (the inactive experts' too) while the weights were BlockSpec'd operands.
    kernels = hlo.custom_call_operands(text, "moetext_fused_")
    assert len(kernels) == (4 if "sharding.preset=fsdp" in overrides else 2) * fused
    for (_, name), shapes in kernels.items():
        weights = shapes[-2:] if name.startswith("moetext_fused_moe") else shapes[-1:]
        assert all(hlo.ARRAY_RE.match(sh)[2].count(",") == 2 for sh in weights), shapes
        assert all("S(1)" not in sh for sh in weights), (name, shapes)
