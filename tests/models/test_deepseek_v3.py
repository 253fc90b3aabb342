"""The deepseek_v3 family: the whole tiny decoder against a float64 NumPy reference (dense
prefix, MoE layer with a shared expert, group-limited sigmoid routing with a non-zero selection
bias, packed rows); scan_layers; latent-cache decoding; parameter counts by hand and for the
published shapes; the selection bias update; the tiny config through the CLI (train, then
`python -m moetext.generate`); num_heads against the tensor axis.

Tolerances (float32 model vs float64 reference): activations are O(1) and every contraction is
at most 64 terms, so one layer rounds at ~1e-6 relative; three layers and the LM head stay
within 1e-4 max-abs on logits of size ~1 (measured ~1e-6). Decoding reassociates the same
float32 sums: 1e-5 max-abs (the issue's bound).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from np_ref import rms_norm, sigmoid_gate, swiglu
from test_mla import np_mla, np_params
from tiny_configs import KERNELS, TINY_DEEPSEEK_MOE, tiny_deepseek

from fake_devices import worker_env
from moetext import config, models
from moetext.generate.decode import generate_ids
from moetext.models.deepseek_v3.model import mla_config
from moetext.models.moe.decode import prefuse_all

REPO = Path(__file__).resolve().parents[2]
TINY_YML = REPO / "configs/models/tiny-deepseek-v3.yml"
NEVER = 10**6  # an EOS id no model here produces


def _build(m=None, moe=TINY_DEEPSEEK_MOE, seed=0):
    model = models.build(m or tiny_deepseek(), moe, KERNELS, rngs=nnx.Rngs(params=seed))
    _randomize_state(model, seed)
    return model


def _randomize_state(model, seed):
    """Norm scales away from ones and a non-zero selection bias, so the reference checks that
    each is applied (both start at ones / zeros)."""
    key = jax.random.key(seed + 100)
    flat = nnx.to_flat_state(nnx.state(model))
    for i, (path, var) in enumerate(flat):
        k = jax.random.fold_in(key, i)
        if path[-1] == "scale":
            var.set_value(1 + 0.3 * jax.random.normal(k, var.get_value().shape))
        elif path[-1] == "selection_bias":
            var.set_value(0.1 * jax.random.normal(k, var.get_value().shape))
    nnx.update(model, nnx.from_flat_state(flat))


def _np(x):
    return np.asarray(x, np.float64)


def np_decoder(model, cfg, moe, tokens_BS, positions_BS, segment_ids_BS):
    """The whole decoder in float64, one row at a time -> (logits [B, S, V], per MoE layer the
    ids [T, K] chosen with and without the selection bias)."""
    mla_cfg, eps = mla_config(cfg), cfg.rms_norm_eps
    out, choices = [], []
    for b in range(tokens_BS.shape[0]):
        x = _np(model.embed[...])[tokens_BS[b]]
        for layer in model.layers:
            h = x + np_mla(
                np_params(layer.attn),
                mla_cfg,
                rms_norm(x, layer.attn_norm.scale[...], eps),
                positions_BS[b],
                segment_ids_BS[b],
            )
            n = rms_norm(h, layer.mlp_norm.scale[...], eps)
            mlp = layer.mlp
            if not layer.use_moe:
                x = h + swiglu(n, mlp.w_gate[...], mlp.w_up[...], mlp.w_down[...])
                continue
            logits = n @ _np(mlp.router.w[...])
            bias = _np(mlp.router.selection_bias[...])
            gate = (moe.num_experts_per_tok, moe.n_group, moe.topk_group, moe.norm_topk_prob)
            w, ids, _ = sigmoid_gate(logits, bias, *gate, moe.routed_scaling_factor)
            choices.append((ids, sigmoid_gate(logits, 0 * bias, *gate, 1.0)[1]))
            ex = mlp.experts
            y = swiglu(n, mlp.shared.w_gate[...], mlp.shared.w_up[...], mlp.shared.w_down[...])
            for t in range(len(n)):
                for j, e in enumerate(ids[t]):
                    y[t] += w[t, j] * swiglu(n[t], ex.w_gate[e], ex.w_up[e], ex.w_down[e])
            x = h + y
        x = rms_norm(x, model.final_norm.scale[...], eps)
        out.append(x @ _np(model.head_VD()).T)
    return np.stack(out), choices


def test_forward_matches_float64_reference_on_packed_rows():
    cfg, moe = tiny_deepseek(), TINY_DEEPSEEK_MOE
    model = _build()
    # Row 0: three documents; row 1: one document, then padding (segment 0).
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    pos = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 0, 0]]) * 3
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, seg.shape)
    logits, aux = nnx.jit(lambda m, t, p, g: m(t, positions_BS=p, segment_ids_BS=g))(
        model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)
    )
    want, choices = np_decoder(model, cfg, moe, tokens, pos, seg)
    real = seg != 0  # padding positions' outputs are junk the loss masks out
    assert np.abs(want[real]).max() > 0.3  # O(1) logits: the tolerance is meaningful
    np.testing.assert_allclose(np.asarray(logits)[real], want[real], rtol=0, atol=1e-4)
    # The bias really changed which experts some tokens use (else it would go untested).
    assert any((biased != plain).any() for biased, plain in choices)
    assert aux["expert_counts"].shape == (2, moe.num_experts)  # layers 1 and 2 are MoE
    assert np.isfinite(float(aux["moe_loss"]))


def test_scan_layers_equals_unscanned():
    """Unscanned with save_dots, scanned with full remat: same logits, aux and gradients."""
    family, m = models.get_family("deepseek_v3"), tiny_deepseek()
    flat = models.build(
        tiny_deepseek(remat_policy="save_dots"), TINY_DEEPSEEK_MOE, KERNELS, rngs=nnx.Rngs(0)
    )
    scanned = models.build(
        tiny_deepseek(scan_layers=True, remat_policy="full"),
        TINY_DEEPSEEK_MOE,
        KERNELS,
        rngs=nnx.Rngs(0),
    )
    # Same seed, same weights: the unscanned params restacked are the scanned ones.
    stacked = family.stack_layers(nnx.to_pure_dict(nnx.state(flat, nnx.Param)), m)
    jax.tree.map(
        np.testing.assert_array_equal, stacked, nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    )
    # Random norms and bias in one, restacked into the other.
    _randomize_state(flat, 0)
    nnx.update(scanned, family.stack_layers(nnx.to_pure_dict(nnx.state(flat)), m))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 12)))

    def loss(model):
        logits, aux = model(tokens)
        return jnp.mean(logits**2) + aux["moe_loss"], (logits, aux)

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (_, (l1, a1)), g1 = grad(flat)
    (_, (l2, a2)), g2 = grad(scanned)
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1e-5)
    for k in a1:
        np.testing.assert_allclose(a2[k], a1[k], rtol=0, atol=1e-5, err_msg=k)
    g1 = family.stack_layers(nnx.to_pure_dict(g1), m)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
        g1,
        nnx.to_pure_dict(g2),
    )


# fused: the routed experts through the fused decode kernel (interpreted), DeepSeek-V3's
# sigmoid routing, scaling and shared expert outside it.
@pytest.mark.parametrize("decode_moe", ["auto", "fused"])
def test_latent_cache_decoding_equals_uncached_forward(decode_moe):
    model, reference = _build(seed=3), _build(seed=3)
    assert prefuse_all(model, decode_moe) == 2  # what moetext.generate decodes with
    spec = models.get_family("deepseek_v3").decode_cache(tiny_deepseek(), 3, 32)
    # The cache holds the latent and the shared RoPE key per token and layer, nothing per head.
    assert [(c.latent_BTC.shape, c.k_rope_BTR.shape) for c in spec] == [
        ((3, 32, 16), (3, 32, 8))
    ] * 3
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (5, 9, 3)]  # left-padded to 32
    out = generate_ids(
        model, prompts, max_new_tokens=6, eos_id=NEVER, return_logits=True, bucket=32
    )
    assert out.logits is not None
    # One forward over the rows right-padded to one length: causal, so the padding after a
    # position cannot change its logits.
    seqs = [prompt + out.tokens[b] for b, prompt in enumerate(prompts)]
    width = max(map(len, seqs))
    padded = jnp.asarray([q + [0] * (width - len(q)) for q in seqs], jnp.int32)
    full_BSV = np.asarray(nnx.jit(lambda m, t: m(t)[0])(reference, padded))
    for b, prompt in enumerate(prompts):
        full = full_BSV[b]
        for i in range(6):
            want = full[len(prompt) + i - 1]  # the logits that chose new token i
            np.testing.assert_allclose(out.logits[b, i], want, atol=1e-5, rtol=0)
            assert out.tokens[b][i] == int(np.argmax(want))


def test_param_counts_by_hand_and_of_the_built_model():
    m, moe = tiny_deepseek(), TINY_DEEPSEEK_MOE
    d, n, v = 32, 4, 128
    # MLA: q_a 32x24 + its norm 24 + q_b 24x4x16; kv_a 32x(16+8) + its norm 16 + kv_b 16x4x20;
    # o 4x12x32.
    mla = 32 * 24 + 24 + 24 * n * 16 + 32 * 24 + 16 + 16 * n * 20 + n * 12 * d
    dense = 3 * d * 64
    routed = 8 * 3 * d * 16
    moe_layer = d * 8 + 3 * d * 16 + routed  # router + 1 shared expert + 8 experts
    total = 2 * v * d + d + 3 * (mla + 2 * d) + dense + 2 * moe_layer
    counts = models.get_family("deepseek_v3").count_params(m, moe)
    assert counts == {"total": total, "active": total - 2 * 6 * 3 * d * 16, "embedding": v * d}
    model = nnx.eval_shape(lambda: models.build(m, moe, KERNELS, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == total
    tied = dataclasses.replace(m, tie_embeddings=True)
    assert models.get_family("deepseek_v3").count_params(tied, moe)["total"] == total - v * d


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        # Published: DeepSeek-V3 671B / 37B without its MTP module (checked below); Kimi K2
        # "1T" / 32B (1.04T on the model card); Moonlight 16B / 3B (15.29B / 2.24B without
        # embedding and head in its report).
        ("deepseek-v3-671b", 671.0e9, 37.0e9),
        ("kimi-k2", 1.03e12, 32.5e9),
        ("moonlight-16b-a3b", 15.96e9, 2.91e9),
    ],
)
def test_pod_configs_build_abstractly_with_published_counts(name, total, active):
    cfg = config.load(REPO / f"configs/models/{name}.yml")
    count = models.get_family("deepseek_v3").count_params
    if name == "deepseek-v3-671b":
        # The shipped config builds the released MTP module (model.mtp_layers: 1): 685B on
        # the model card, which also counts the embedding and head copies the checkpoint
        # stores in it (shared here).
        with_mtp = count(cfg.model, cfg.moe)["total"]
        assert with_mtp == pytest.approx(685.0e9 - 2 * 129280 * 7168, rel=0.015)
        cfg = config.load(REPO / f"configs/models/{name}.yml", ["model.mtp_layers=0"])
    counts = count(cfg.model, cfg.moe)
    assert counts["total"] == pytest.approx(total, rel=0.015), counts
    assert counts["active"] == pytest.approx(active, rel=0.025), counts
    if name == "moonlight-16b-a3b":  # the report counts without embedding and LM head
        body = counts["total"] - 2 * counts["embedding"]
        assert body == pytest.approx(15.29e9, rel=0.002)
        assert counts["active"] - 2 * counts["embedding"] == pytest.approx(2.24e9, rel=0.005)
    model = nnx.eval_shape(lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(x.shape)) for x in leaves) == counts["total"]


def test_update_model_state_moves_the_selection_bias():
    model = _build()
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 16)))
    _, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
    before = [np.asarray(layer.mlp.router.selection_bias[...]) for layer in model.layers[1:]]
    model.update_model_state(aux)
    rate = TINY_DEEPSEEK_MOE.bias_update_rate
    for i, layer in enumerate(model.layers[1:]):
        counts = np.asarray(aux["expert_counts"][i], np.float64)
        assert counts.sum() == 32 * 2 and counts.std() > 0  # unbalanced: the bias moves
        want = before[i] + rate * np.sign(counts.mean() - counts)
        got = np.asarray(layer.mlp.router.selection_bias[...])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def _cli(*args: str, devices: int | None = None) -> subprocess.CompletedProcess[str]:
    env = worker_env(devices or 1)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=900, cwd=REPO, env=env
    )


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_run")
    steps = [
        "train.steps=60",
        "train.log_every=10",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.peak_tflops=1",
        "checkpoint.every=60",
        f"train.run_dir={d}",
    ]
    r = _cli("-m", "train", str(TINY_YML), *steps)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_tiny_config_trains_from_the_cli(cli_run):
    rows = [json.loads(line) for line in open(cli_run / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 6 and np.isfinite(losses).all()
    # ln(512) = 6.24 at init; 60 steps of real text bring it well down.
    assert losses[-1] < losses[0] - 1.0, losses


def test_generate_runs_on_a_tiny_deepseek_checkpoint(cli_run):
    r = _cli(
        "-m",
        "moetext.generate",
        str(cli_run / "config.yml"),
        "--checkpoint",
        str(cli_run / "checkpoints" / "60"),
        "--prompt",
        "def fibonacci(",
        "--max_new_tokens",
        "8",
        "--jsonl",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert 1 <= len(row["tokens"]) <= 8 and isinstance(row["completion"], str)


def test_num_heads_not_divisible_by_the_tensor_axis_is_one_line():
    r = _cli(
        "-m",
        "train",
        str(TINY_YML),
        "model.num_heads=6",
        "model.num_kv_heads=6",
        "sharding.preset=fsdp_tp",
        "sharding.mesh.tensor=4",
        "data.kind=synthetic",
        devices=4,
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "model.num_heads=6" in last[-1] and "'tensor' of size 4" in last[-1], last[-1]
