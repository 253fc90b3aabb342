"""Packed rows: a document's logits do not depend on its neighbours, and the loss counts only
targets inside a document.

float32 compute, dropless MoE dispatch: capacity dispatch drops tokens by their rank among all
tokens routed to an expert, which couples documents that share a batch, so only dropless makes
a document's MoE output a function of that document alone.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_configs import KERNELS, tiny, tiny_moe

from moetext import models
from moetext.data.batch import KEYS
from moetext.program.step import make_eval_step

V = 128
_rng = np.random.default_rng(0)
X, Y, Z = (_rng.integers(1, V, n) for n in (3, 5, 6))
S1 = 11  # tokens per packed row


def pack(*rows):
    """Rows of documents -> a batch dict [len(rows), S1] (tail padding: segment 0, token 0),
    and the doc offsets per row."""
    batch = {k: np.zeros((len(rows), S1), np.int32) for k in KEYS}
    offsets = []
    for r, docs in enumerate(rows):
        at, offsets_r = 0, []
        for seg, doc in enumerate(docs, start=1):
            batch["tokens"][r, at : at + len(doc)] = doc
            batch["segment_ids"][r, at : at + len(doc)] = seg
            batch["positions"][r, at : at + len(doc)] = np.arange(len(doc))
            offsets_r.append(at)
            at += len(doc)
        offsets.append(offsets_r)
    return batch, offsets


# Row A = [X | Y | padding], row B = [Z | Y]: Y at offsets 3 and 6.
BATCH, OFFSETS = pack([X, Y], [Z, Y])


def _build(**changes):
    cfg = tiny(**changes)
    return models.build(cfg, tiny_moe(dispatch="dropless"), KERNELS, rngs=nnx.Rngs(params=0))


def _scanned_like(model):
    """`model`'s weights in the scanned layout with full remat. Built abstractly and restacked:
    an eager scanned init (nnx.vmap) costs seconds."""
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: _build(scan_layers=True, remat_policy="full"))
    )
    pure = nnx.to_pure_dict(nnx.state(model))
    layers, stacks, start = pure.pop("layers"), {}, 0
    for i, (_, n) in enumerate(nnx.merge(graphdef, state).segments):
        stacks[i] = jax.tree.map(
            lambda *xs: np.stack(xs), *(layers[j] for j in range(start, start + n))
        )
        start += n
    nnx.replace_by_pure_dict(state, {**pure, "stacks": stacks})
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def model():
    return _build()


@nnx.jit
def _forward(model, tokens, positions, segment_ids):
    return model(tokens, positions_BS=positions, segment_ids_BS=segment_ids)[0]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_remat"])
def test_document_logits_do_not_depend_on_neighbours_or_offset(model, scan):
    if scan:  # the segment ids must also reach the scan body through the remat wrapper
        model = _scanned_like(model)
    logits = np.asarray(_forward(model, BATCH["tokens"], BATCH["positions"], BATCH["segment_ids"]))
    alone = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, Y[None].astype(np.int32)))[0]
    (_, a), (_, b) = OFFSETS
    y_a, y_b = logits[0, a : a + len(Y)], logits[1, b : b + len(Y)]
    # Same math on the same document, but its rows sit at other offsets of differently sized
    # matmuls ([B*S, D] projections, the MoE's sorted expert groups), whose row blocking and
    # summation order may differ: equal to float32 rounding, not bitwise. Logits are O(1);
    # measured max |diff| <= 6e-7 (bitwise between the two packed rows here); bound 1e-5.
    np.testing.assert_allclose(y_a, y_b, rtol=0, atol=1e-5)
    np.testing.assert_allclose(y_a, alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(y_b, alone, rtol=0, atol=1e-5)
    assert np.isfinite(logits).all()  # padding queries attend to nothing, without NaNs


def test_loss_counts_only_targets_inside_a_document(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = jax.jit(make_eval_step(graphdef, rest))(params, BATCH)
    inputs = {k: v[:, :-1] for k, v in BATCH.items()}
    logits = np.asarray(
        _forward(model, inputs["tokens"], inputs["positions"], inputs["segment_ids"])
    )
    # Counted: next-token pairs inside each document; not padding, not a document's first token
    # predicted from the previous one.
    counted = np.zeros((2, S1 - 1), bool)
    for r, (docs, offsets) in enumerate(zip([[X, Y], [Z, Y]], OFFSETS, strict=True)):
        for doc, at in zip(docs, offsets, strict=True):
            counted[r, at : at + len(doc) - 1] = True
    assert counted.sum() == sum(len(d) - 1 for d in (X, Y, Z, Y))
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, BATCH["tokens"][:, 1:, None], axis=-1)[..., 0]
    assert float(out["eval_tokens"]) == counted.sum()
    np.testing.assert_allclose(out["eval_nll_sum"], nll[counted].sum(), rtol=1e-6)
    np.testing.assert_allclose(out["eval_ce_loss"], nll[counted].mean(), rtol=1e-6)
