"""Multi-token prediction inside the deepseek_v3 decoder (model.mtp_layers > 0): the trainer's
loss adds mtp_loss_weight x mtp_loss, gradient accumulation and eval agree with it, a tiny
model trains with mtp_loss logged, decoding ignores the MTP modules, and the counts include
them. The MTP math itself is checked against float64 NumPy in test_mtp.py.

Tolerances: the model computes in float32. The loss terms are added as ce + (moe_loss +
lambda * mtp_loss), scalars XLA may fuse into a multiply-add: 2 float32 ulps (rel 2.5e-7).
Accumulated vs unsplit steps run the same products summed in another order: 2e-6 relative on
losses, 1e-5 of each gradient's largest entry (tests/train/test_grad_accum.py's bounds).
"""

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
from tiny_configs import KERNELS, TINY_DEEPSEEK_MOE, tiny_deepseek

from moetext import config, models, program, train
from moetext.data.batch import from_tokens, target_mask
from moetext.generate.decode import generate_ids
from moetext.models.deepseek_v3.mtp import depth_mask
from moetext.program.step import accumulated_value_and_grad, make_eval_step, make_loss_fn

REPO = Path(__file__).resolve().parents[2]
QWEN_YML = REPO / "configs/models/tiny-qwen3-moe.yml"
QUIET = ["train.progress_bar=false", "train.peak_tflops=1.0", "checkpoint.enabled=false"]
B, S, LAMBDA = 4, 16, 0.3


def _changed(section) -> dict:
    """A config section's fields that differ from their defaults, as YAML values."""
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


@pytest.fixture(scope="module")
def yml(tmp_path_factory) -> Path:
    """tiny-qwen3-moe.yml's run settings with tiny_configs' deepseek_v3 model and moe."""
    raw = yaml.safe_load(QWEN_YML.read_text())
    raw["base_config"] = str(QWEN_YML.parent / raw["base_config"])
    raw["model"] = _changed(tiny_deepseek())
    raw["moe"] = _changed(TINY_DEEPSEEK_MOE)
    path = tmp_path_factory.mktemp("cfg") / "tiny-deepseek-mtp.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cfg(yml: Path, extra=()):
    return config.load(
        yml,
        [
            *QUIET,
            "data.kind=synthetic",
            f"data.seq_len={S}",
            f"data.global_batch_size={B}",
            "model.mtp_layers=1",
            f"model.mtp_loss_weight={LAMBDA}",
            "moe.aux_loss_weight=0.001",  # a non-zero moe_loss beside mtp_loss
            "moe.aux_loss_scope=sequence",  # DeepSeek-V3's; per row, so per micro-batch exact
            *extra,
        ],
    )


def _batch(packed: bool):
    tokens = np.random.default_rng(0).integers(0, 128, (B, S + 1)).astype(np.int32)
    batch = from_tokens(tokens)
    if packed:  # two documents in row 1, padding at the end of row 2
        batch["segment_ids"][1, 6:] = 2
        batch["positions"][1, 6:] = np.arange(S + 1 - 6)
        batch["segment_ids"][2, 12:] = 0
    return batch


@pytest.fixture(scope="module")
def built(yml):
    return program.build(_cfg(yml), jax.devices()[:1])


def test_total_loss_is_ce_plus_moe_plus_weighted_mtp(built):
    b = built
    loss_fn = jax.jit(make_loss_fn(b.graphdef, b.rest))
    loss, (ce, aux, _, _) = loss_fn(b.state.params, _batch(packed=True), b.state.model_state)
    mtp, moe = np.float32(aux["mtp_loss"]), np.float32(aux["moe_loss"])
    assert np.isfinite(mtp) and mtp > 0 and moe > 0
    assert float(aux["extra_loss"]) == pytest.approx(LAMBDA * float(mtp), rel=2.5e-7)
    want = np.float32(ce) + (moe + np.float32(LAMBDA) * mtp)
    assert float(loss) == pytest.approx(float(want), rel=2.5e-7)
    # The MTP layer is the model's third MoE layer: its row follows the stack's two.
    assert aux["expert_load"].shape == (3, 8)
    # Eval adds the same terms.
    ev = jax.jit(make_eval_step(b.graphdef, b.rest))(
        b.state.params, _batch(packed=True), b.state.model_state
    )
    assert float(ev["eval_loss"]) == pytest.approx(float(loss), rel=2.5e-7)
    assert float(ev["eval_mtp_loss"]) == float(aux["mtp_loss"])


def test_eval_in_micro_batches_reports_the_whole_batch_mtp_loss(built, yml):
    b = built
    batch = _uneven_batch()
    one = jax.jit(make_eval_step(b.graphdef, b.rest))(b.state.params, batch, b.state.model_state)
    two = jax.jit(make_eval_step(b.graphdef, b.rest, 2))(b.state.params, batch, b.state.model_state)
    assert float(two["eval_mtp_loss"]) == pytest.approx(float(one["eval_mtp_loss"]), rel=2e-6)
    assert float(two["eval_loss"]) == pytest.approx(float(one["eval_loss"]), rel=2e-6)
    # A model without MTP reports no eval_mtp_loss (no loss terms).
    plain = program.build(_cfg(yml, ["model.mtp_layers=0"]), jax.devices()[:1])
    ev = jax.jit(make_eval_step(plain.graphdef, plain.rest))(
        plain.state.params, batch, plain.state.model_state
    )
    assert "eval_mtp_loss" not in ev and "eval_loss" in ev


def _uneven_batch():
    """Micro-batches (of 2, strided: rows 0, 2 and rows 1, 3) with unequal MTP target counts:
    row 2 is mostly padding, rows 0 and 1 hold two documents each, a loss mask drops part of
    row 3. (Three documents in each micro-batch: the sequence-wise balance loss, a mean over
    documents per micro-batch, is then the step's too.)"""
    batch = _batch(packed=True)
    batch["segment_ids"][0, 10:] = 2
    batch["positions"][0, 10:] = np.arange(S + 1 - 10)
    batch["segment_ids"][2, 5:] = 0
    batch["loss_mask"] = np.ones_like(batch["tokens"])
    batch["loss_mask"][3, 3:9] = 0
    return batch


def test_gradient_accumulation_equals_the_whole_batch(built):
    # The micro-batches count different numbers of MTP targets: mtp_loss (the sum over the
    # step's valid targets / their count, per depth) and its gradients are still the unsplit
    # step's, as the CE's are.
    b = built
    batch = _uneven_batch()
    loss_fn = make_loss_fn(b.graphdef, b.rest)
    mask, seg = target_mask(batch), batch["segment_ids"][:, :-1]
    counts = [
        int(depth_mask(jnp.asarray(mask[r::2]), jnp.asarray(seg[r::2]), 1).sum()) for r in (0, 1)
    ]
    assert counts[0] != counts[1], counts
    plain = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    split = jax.jit(accumulated_value_and_grad(loss_fn, 2))
    (l1, (_, aux1, _, _)), g1 = plain(b.state.params, batch, b.state.model_state)
    (l2, (_, aux2, _, _)), g2 = split(b.state.params, batch, b.state.model_state)
    assert float(aux2["mtp_loss"]) == pytest.approx(float(aux1["mtp_loss"]), rel=2e-6)
    # moe_loss is a per-micro-batch statistic (sequence-scope balance loss: per row, so the
    # same mean here); the totals agree.
    assert float(l2) == pytest.approx(float(l1), rel=2e-6)
    for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert float(jnp.max(jnp.abs(c - a))) <= 1e-5 * float(jnp.max(jnp.abs(a)))
    # Each micro-batch's own mean differs from the step's, so the old per-micro-batch mean
    # (the mean of the two) would not have matched: the check above can fail.
    own = []
    for r in (0, 1):
        micro = {k: v[r::2] for k, v in batch.items()}
        own.append(
            float(jax.jit(loss_fn)(b.state.params, micro, b.state.model_state)[1][1]["mtp_loss"])
        )
    assert abs(np.mean(own) - float(aux1["mtp_loss"])) > 1e-4 * float(aux1["mtp_loss"]), own
    # The gradient reaches every MTP param and the shared embedding and head.
    mtp = nnx.to_flat_state(g1["mtp"])
    assert mtp and all(float(jnp.max(jnp.abs(v.get_value()))) > 0 for _, v in mtp), [
        p for p, v in mtp if float(jnp.max(jnp.abs(v.get_value()))) == 0
    ]


def test_tiny_deepseek_with_mtp_trains_and_logs_mtp_loss(yml, tmp_path):
    cfg = _cfg(
        yml,
        [
            "train.steps=6",
            "train.log_every=3",
            "train.eval_every=6",
            "model.scan_layers=true",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )
    train.run(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [3, 6]
    for r in logged:
        assert np.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0
        want = r["ce_loss"] + r["moe_loss"] + LAMBDA * r["mtp_loss"]
        assert r["loss"] == pytest.approx(want, rel=1e-6)
        # The MTP layer's routing row is labelled as HF numbers it: model.layers.{num_layers}.
        assert {k for k in r if k.startswith("max_vio/")} == {
            f"max_vio/layer_{i}" for i in (1, 2, 3)
        }
    assert np.isfinite(logged[-1]["eval_loss"])
    assert np.isfinite(logged[-1]["eval_mtp_loss"]) and logged[-1]["eval_mtp_loss"] > 0


def test_decoding_ignores_the_mtp_modules():
    with_mtp = dataclasses.replace(tiny_deepseek(), mtp_layers=1)
    m1 = models.build(with_mtp, TINY_DEEPSEEK_MOE, KERNELS, rngs=nnx.Rngs(params=5))
    m0 = models.build(tiny_deepseek(), TINY_DEEPSEEK_MOE, KERNELS, rngs=nnx.Rngs(params=5))
    s1, s0 = nnx.state(m1, nnx.Param), nnx.state(m0, nnx.Param)
    assert "mtp" in s1 and "mtp" not in s0  # kept in the model's state (checkpoints)
    # The main params are drawn as without MTP; the MTP modules come after them.
    main = {k: v for k, v in nnx.to_pure_dict(s1).items() if k != "mtp"}
    jax.tree.map(np.testing.assert_array_equal, main, nnx.to_pure_dict(s0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 12)))
    l1, aux1 = m1(tokens)
    l0, _ = m0(tokens)
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l0))
    assert "mtp_loss" not in aux1  # no targets: the MTP modules did not run
    prompts = [[1, 2, 3, 4], [5, 6]]
    a = generate_ids(m1, prompts, max_new_tokens=4, eos_id=10**6, bucket=16)
    c = generate_ids(m0, prompts, max_new_tokens=4, eos_id=10**6, bucket=16)
    assert a.tokens == c.tokens


def test_counts_and_flops_include_the_mtp_modules():
    family = models.get_family("deepseek_v3")
    m0, moe = tiny_deepseek(), TINY_DEEPSEEK_MOE
    m1 = dataclasses.replace(m0, mtp_layers=1)
    c0, c1 = family.count_params(m0, moe), family.count_params(m1, moe)
    model = nnx.eval_shape(lambda: models.build(m1, moe, KERNELS, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == c1["total"]
    mtp_params = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param))
    )
    assert c1["total"] - c0["total"] == mtp_params
    d, v, e, k, f = m0.emb_dim, m0.vocab_size, moe.num_experts, moe.num_experts_per_tok, 16
    inactive = (e - k) * 3 * d * f
    assert c1["active"] - c0["active"] == mtp_params - inactive  # active includes MTP
    # FLOPs: 6 x its active params, its one MLA layer's attention term, the shared head again.
    seq = 64
    attention = 6 * m0.num_heads * (m0.qk_nope_head_dim + m0.qk_rope_head_dim + m0.v_head_dim)
    want = 6 * (mtp_params - inactive) + attention * seq + 6 * d * v
    got = family.flops_per_token(m1, moe, seq) - family.flops_per_token(m0, moe, seq)
    assert got == pytest.approx(want, rel=1e-12)
