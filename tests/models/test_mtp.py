"""DeepSeek-V3 multi-token prediction (models/deepseek_v3/mtp.py) against a float64 NumPy
reference written from the equations, with packed documents, padding and a chat loss mask.

The depth's decoder layer is one the test passes in (the module takes any layer from the
decoder's factory): a position-wise residual layer x + tanh(x W) with a two-line NumPy twin,
so the reference checks MTP's own math (the shifts, the concatenation order, the norms, the
shared embedding and head, the masks) exactly. The decoder's real MLA + MoE layer runs in
tests/models/test_deepseek_mtp.py.

Tolerance: the module computes in float32 (about 1e-7 relative per operation over a few
dozen operations of D = 16); 2e-5 relative on the loss is a few times what was measured.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from np_ref import f64, rms_norm

from moetext.data.batch import target_mask
from moetext.models import EXTRA_LOSS_KEY, LossTargets
from moetext.models.deepseek_v3.mtp import MTP
from moetext.program.loss import fused_masked_nll, logits_masked_nll

B, S, D, V, K = 3, 12, 16, 40, 2
EPS = 1e-6
WEIGHT = 0.3


class ResidualTanh(nnx.Module):
    """x -> x + tanh(x W): a position-wise stand-in for the decoder layer of a depth."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.3)

    def __call__(self, x_BSD):
        return x_BSD + jnp.tanh(x_BSD @ self.w[...]), {}


def run_layer(layer, x_BSD):
    return layer(x_BSD)


def make_mtp(seed=0):
    rngs = nnx.Rngs(params=seed)
    mtp = MTP(
        K,
        D,
        lambda k: ResidualTanh(rngs),
        weight=WEIGHT,
        eps=EPS,
        init_std=0.3,
        param_dtype="float32",
        rngs=rngs,
    )
    # Norm scales away from their init of ones, so a swapped enorm/hnorm would show.
    for i, depth in enumerate(mtp.depths):
        for j, norm in enumerate((depth.enorm, depth.hnorm, depth.shared_head.norm)):
            norm.scale[...] = 1.0 + 0.1 * (i + 1) * (j + 1) * jnp.cos(jnp.arange(D))
    return mtp


def make_batch():
    """[B, S + 1] rows: row 0 one document; row 1 three documents (one of 2 tokens, shorter
    than the depths) and padding; row 2 two documents and a chat loss_mask."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (B, S + 1)).astype(np.int32)
    seg = np.ones((B, S + 1), np.int32)
    seg[1, 4:6], seg[1, 6:10], seg[1, 10:] = 2, 3, 0
    seg[2, 7:] = 2
    loss_mask = np.ones((B, S + 1), np.int32)
    loss_mask[2, 2:5] = 0
    return {"tokens": tokens, "segment_ids": seg, "loss_mask": loss_mask}


def reference(batch, h0, embed, head, mtp):
    """(mtp_loss, per-depth counts) in float64, from the equations (module docstring) with
    the masks written per position over the [B, S + 1] rows."""
    tokens, seg, lm = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
    h = f64(h0)
    losses, counts = [], []
    for k, depth in enumerate(mtp.depths, start=1):
        # Emb(t_{i+k}) (an index past the row reads the last token: its targets never count).
        emb = f64(embed)[tokens[:, np.minimum(np.arange(S) + k, S)]]
        x = np.concatenate(
            [
                rms_norm(emb, np.asarray(depth.enorm.scale[...]), EPS),
                rms_norm(h, np.asarray(depth.hnorm.scale[...]), EPS),
            ],
            axis=-1,
        ) @ f64(depth.eh_proj[...])
        h = x + np.tanh(x @ f64(depth.layer.w[...]))
        logits = rms_norm(h, np.asarray(depth.shared_head.norm.scale[...]), EPS) @ f64(head).T
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll, count = 0.0, 0
        for b in range(B):
            for i in range(S):
                t = i + k + 1  # the target's index in the row
                valid = (
                    t <= S
                    and seg[b, t] != 0
                    and all(seg[b, j] == seg[b, i] for j in range(i, t + 1))
                    and lm[b, t] != 0
                )
                if valid:
                    nll -= logp[b, i, tokens[b, t]]
                    count += 1
        losses.append(nll / count)
        counts.append(count)
    return float(np.mean(losses)), counts


def run(mtp, batch, h0, embed, head, nll):
    targets = LossTargets(jnp.asarray(batch["tokens"][:, 1:]), jnp.asarray(target_mask(batch)), nll)
    return mtp(h0, embed, head, targets, jnp.asarray(batch["segment_ids"][:, :-1]), run_layer)


@pytest.fixture(scope="module")
def setup():
    mtp = make_mtp()
    keys = jax.random.split(jax.random.key(2), 3)
    h0 = jax.random.normal(keys[0], (B, S, D))
    embed = jax.random.normal(keys[1], (V, D))
    head = jax.random.normal(keys[2], (V, D)) * 0.5
    return mtp, make_batch(), h0, embed, head


@pytest.mark.parametrize(
    "nll",
    [logits_masked_nll, lambda h, w, t, m: fused_masked_nll(h, w, t, m, chunk_size=16)],
    ids=["logits", "fused"],
)
def test_mtp_loss_matches_numpy_reference(setup, nll):
    mtp, batch, h0, embed, head = setup
    want, counts = reference(batch, h0, embed, head, mtp)
    # The masks drop what they should: row 1's 2-token document and padding, row 2's
    # boundary and loss mask; depth 2 counts fewer targets than depth 1.
    assert counts[0] > counts[1] > 0
    aux, layer_aux = run(mtp, batch, h0, embed, head, nll)
    assert layer_aux == [{}, {}]
    np.testing.assert_allclose(float(aux["mtp_loss"]), want, rtol=2e-5)
    assert float(aux[EXTRA_LOSS_KEY]) == pytest.approx(WEIGHT * float(aux["mtp_loss"]), rel=1e-7)


def test_masked_targets_do_not_change_the_loss(setup):
    """Changing tokens MTP may only reach across a document boundary (padding; a document's
    first token, which only positions of the previous document read as an MTP input or
    target) leaves mtp_loss as it was; changing a counted one changes it. (A loss-masked
    token still counts as context: depth 2 at position i reads it through h_1.)"""
    mtp, batch, h0, embed, head = setup
    base = float(run(mtp, batch, h0, embed, head, logits_masked_nll)[0]["mtp_loss"])
    masked = {k: v.copy() for k, v in batch.items()}
    masked["tokens"][1, 10:] = (masked["tokens"][1, 10:] + 7) % V  # padding
    masked["tokens"][1, [4, 6]] = (masked["tokens"][1, [4, 6]] + 5) % V  # documents' first
    masked["tokens"][2, 7] = (masked["tokens"][2, 7] + 3) % V
    got = float(run(mtp, masked, h0, embed, head, logits_masked_nll)[0]["mtp_loss"])
    assert got == base
    counted = {k: v.copy() for k, v in batch.items()}
    counted["tokens"][0, 5] = (counted["tokens"][0, 5] + 1) % V
    assert float(run(mtp, counted, h0, embed, head, logits_masked_nll)[0]["mtp_loss"]) != base


def test_gradients_reach_mtp_and_the_shared_embedding_and_head(setup):
    mtp, batch, h0, embed, head = setup
    graphdef, params = nnx.split(mtp)

    def loss(params, h0, embed, head):
        m = nnx.merge(graphdef, params)
        return run(m, batch, h0, embed, head, logits_masked_nll)[0]["mtp_loss"]

    g_params, g_h0, g_embed, g_head = jax.grad(loss, argnums=(0, 1, 2, 3))(params, h0, embed, head)
    for path, g in jax.tree_util.tree_leaves_with_path(g_params):
        assert float(jnp.max(jnp.abs(g))) > 0, path
    for name, g in (("h0", g_h0), ("embed", g_embed), ("head", g_head)):
        assert float(jnp.max(jnp.abs(g))) > 0, name
    # Only the embedding rows of tokens some depth reads get a gradient.
    read = set(batch["tokens"][:, 1:].ravel().tolist())
    unread = [v for v in range(V) if v not in read]
    assert unread and float(jnp.max(jnp.abs(g_embed[jnp.asarray(unread)]))) == 0.0
