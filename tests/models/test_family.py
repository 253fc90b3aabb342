"""Model families: one defined in this file alone is registered and trained by the real loop;
every family's declared counts and logical axes are what its built model really has."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from tiny_configs import KERNELS, TINY_MOE, tiny

from moetext import config, models, train
from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.models.flops import dot_product_attention_flops
from moetext.models.layers.attention import Attention
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.rope import rope_cos_sin
from moetext.models.moe.block import AUX_KEYS, LOAD_KEY, MoEBlock
from moetext.models.moe.experts import gmm_from_config
from moetext.sharding import plan as sharding_plan
from moetext.train import loop

REPO = Path(__file__).resolve().parents[2]
TINY_YML = REPO / "configs/models/tiny-qwen3-moe.yml"


def toy_yml(tmp_path: Path, family: str) -> Path:
    """The tiny config for `family`: the same file without its Qwen-only fields (the test
    families read the shared model/moe sections only)."""
    raw = yaml.safe_load(TINY_YML.read_text())
    raw["base_config"] = str(TINY_YML.parent / raw["base_config"])
    raw["model"] = {k: v for k, v in raw["model"].items() if k != "qk_norm"} | {"family": family}
    path = tmp_path / f"{family}.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


# --- A toy family, defined here only: parallel attention + MoE (GPT-J / PaLM style) --------
# x + attn(norm(x)) + moe(norm(x)) with one norm per layer, MoE in every even layer (the odd
# layers are attention only), the LM head tied to the embedding.


def _toy_pattern(m: ModelConfig) -> tuple[bool, ...]:
    return tuple(i % 2 == 0 for i in range(m.num_layers))


class ParallelLayer(nnx.Module):
    def __init__(self, m: ModelConfig, moe: MoEConfig, gmm, *, use_moe: bool, rngs: nnx.Rngs):
        pdt = as_dtype(m.param_dtype)
        self.norm = RMSNorm(m.emb_dim, eps=m.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(m, qk_norm=True, rngs=rngs)
        self.moe = (
            MoEBlock(
                moe,
                gmm,
                emb_dim=m.emb_dim,
                init_std=m.init_std,
                param_dtype=pdt,
                dtype=as_dtype(m.dtype),
                rngs=rngs,
            )
            if use_moe
            else None
        )

    def __call__(self, x, cos, sin, seg):
        h = self.norm(x)
        out = x + self.attn(h, cos, sin, seg)
        if self.moe is None:
            return out, None
        y, aux = self.moe(h)
        return out + y, aux


class ParallelLM(nnx.Module):
    def __init__(self, m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs):
        pdt, self.dtype, self.m = as_dtype(m.param_dtype), as_dtype(m.dtype), m
        gmm = gmm_from_config(k)
        self.embed = make_param(
            rngs, normal(m.init_std), (m.vocab_size, m.emb_dim), ("vocab", "embed"), pdt
        )
        self.layers = nnx.List(
            [ParallelLayer(m, moe, gmm, use_moe=u, rngs=rngs) for u in _toy_pattern(m)]
        )
        self.final_norm = RMSNorm(m.emb_dim, eps=m.rms_norm_eps, param_dtype=pdt, rngs=rngs)

    def __call__(self, tokens_BS, *, positions_BS=None, segment_ids_BS=None):
        b, s = tokens_BS.shape
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        cos, sin = rope_cos_sin(positions_BS, self.m.head_dim, self.m.rope_theta)
        x = jnp.take(self.embed[...], tokens_BS, axis=0).astype(self.dtype)
        auxes = []
        for layer in self.layers:
            x, aux = layer(x, cos, sin, segment_ids_BS)
            if aux is not None:
                auxes.append(aux)
        x = self.final_norm(x)
        logits = jnp.einsum("bsd,vd->bsv", x, self.embed[...].astype(self.dtype))
        out = {key: sum(a[key] for a in auxes) / len(auxes) for key in AUX_KEYS}
        out[LOAD_KEY] = jnp.stack([a[LOAD_KEY] for a in auxes])
        return logits.astype(jnp.float32), out


def _toy_counts(m: ModelConfig, moe: MoEConfig) -> models.ParamCounts:
    d, h = m.emb_dim, m.head_dim
    attn = d * m.num_heads * h * 2 + 2 * d * m.num_kv_heads * h + 2 * h  # q/k norms
    expert = 3 * d * moe.moe_intermediate_size
    n_moe = sum(_toy_pattern(m))
    embedding = m.vocab_size * d
    total = embedding + d + m.num_layers * (attn + d) + n_moe * (d * moe.num_experts)
    total += n_moe * moe.num_experts * expert
    active = total - n_moe * (moe.num_experts - moe.num_experts_per_tok) * expert
    return {"total": total, "active": active, "embedding": embedding}


def _toy_flops(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    c = _toy_counts(m, moe)
    # The tied table is gathered (no FLOPs) and used as the head matmul (D * V).
    nonembedding = c["active"] - c["embedding"] + m.emb_dim * m.vocab_size
    attention = dot_product_attention_flops(m.num_layers, m.num_heads, m.head_dim, seq_len)
    return 6 * nonembedding + attention


TOY = models.register_family(
    models.ModelFamily(
        name="toy_parallel",
        description="test-only parallel attention + MoE block, tied head",
        build=ParallelLM,
        moe_layers=_toy_pattern,
        count_params=_toy_counts,
        flops_per_token=_toy_flops,
        logical_axes=frozenset(
            {"batch", "length", "embed", "vocab", "heads", "kv_heads", "head_dim"}
            | {"norm", "exp", "mlp_moe"}
        ),
    )
)


def _param_counts(model: nnx.Module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _used_logical_axes(m: ModelConfig) -> set[str]:
    """Every logical name the family's params carry and its forward pass constrains."""
    model = nnx.eval_shape(lambda: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    names: set[str] = set()
    for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names.update(n for n in sharding_plan.logical_names(var) or () if n is not None)
    plan = sharding_plan.make_plan(config.load(TINY_YML).sharding, jax.devices()[:1])
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    with plan.rules(), sharding_plan.record_logical_names() as seen:
        jax.eval_shape(lambda t: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0))(t), tokens)
    return names | {n for n in seen if n is not None}


def test_toy_family_is_registered_and_built_by_name():
    assert "toy_parallel" in models.available_families()
    assert models.get_family("toy_parallel") is TOY
    m = tiny(family="toy_parallel", num_layers=3)
    model = nnx.eval_shape(lambda: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    assert isinstance(model, ParallelLM)
    assert _param_counts(model) == TOY.count_params(m, TINY_MOE)["total"]
    # A second family of the same name is refused unless replaced on purpose.
    with pytest.raises(ValueError, match="'toy_parallel' is already registered"):
        models.register_family(dataclasses.replace(TOY, description="another"))


@pytest.mark.parametrize(
    ("m", "unused"),
    [
        (tiny(), {"layers"}),  # qwen3_moe: dense, MoE, MoE; "layers" is scan_layers' axis
        (tiny(scan_layers=True), set()),
        (tiny(family="dense"), {"layers"}),
        (tiny(family="toy_parallel"), set()),
    ],
    ids=["qwen3_moe", "qwen3_moe-scan", "dense", "toy_parallel"],
)
def test_declared_counts_and_logical_axes_are_the_built_models(m, unused):
    family = models.get_family(m.family)
    model = nnx.eval_shape(lambda: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    assert family.count_params(m, TINY_MOE)["total"] == _param_counts(model)
    assert len(family.moe_layers(m)) == m.num_layers
    assert family.logical_axes - _used_logical_axes(m) == unused
    assert _used_logical_axes(m) <= family.logical_axes


def test_a_family_defined_in_a_test_trains_through_the_real_loop(tmp_path):
    cfg = config.load(
        toy_yml(tmp_path, "toy_parallel"),
        [
            "model.num_layers=3",
            "data.kind=synthetic",
            "train.steps=40",
            "train.log_every=10",
            "train.eval_every=0",
            "train.progress_bar=false",
            "train.peak_tflops=1.0",
            "checkpoint.enabled=false",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )
    last = train.run(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [10, 20, 30, 40]
    # log(512) = 6.24 nats at init; the synthetic Markov chain is learnable.
    assert losses[40] < losses[10] - 0.5 and np.isfinite(list(losses.values())).all(), losses
    # expert_load rows are labelled with the family's MoE layers (0 and 2), not Qwen's rule.
    assert {k for k in rows[-1] if k.startswith("expert_imbalance/")} == {
        "expert_imbalance/layer_0",
        "expert_imbalance/layer_2",
    }
    # MFU used the family's own FLOP count.
    fpt = TOY.flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
    assert last["mfu"] == pytest.approx(fpt * last["tokens_per_s"] / 1e12, rel=1e-6)


def test_a_logical_axis_the_preset_lacks_fails_before_anything_is_built(tmp_path):
    odd = models.register_family(
        dataclasses.replace(TOY, name="toy_odd_axis", logical_axes=TOY.logical_axes | {"toy_axis"})
    )
    cfg = config.load(toy_yml(tmp_path, odd.name), ["data.kind=synthetic"])
    with pytest.raises(ConfigError, match=r"'toy_axis' of model family 'toy_odd_axis'"):
        loop.build(cfg)
