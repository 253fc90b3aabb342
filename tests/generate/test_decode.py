"""KV-cache decoding equals recomputing the whole forward at every position; sampling rules."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_configs import KERNELS, TINY_MOE, tiny  # noqa: E402

from moetext import models  # noqa: E402
from moetext.errors import ConfigError  # noqa: E402
from moetext.generate.decode import generate_ids  # noqa: E402
from moetext.generate.sampling import Sampling, sample  # noqa: E402
from moetext.models.moe.decode import prefuse_all  # noqa: E402

NEVER = 10**6  # an EOS id no model here can produce: every row runs max_new_tokens


def _model(family: str = "qwen3_moe", norm_topk_prob: bool = True):
    moe = dataclasses.replace(TINY_MOE, norm_topk_prob=norm_topk_prob)
    return models.build(tiny(family=family), moe, KERNELS, rngs=nnx.Rngs(params=3))


@pytest.mark.parametrize(
    ("family", "norm_topk_prob", "prefused"),
    [
        ("qwen3_moe", True, False),
        ("qwen3_moe", False, False),
        ("qwen3_moe", True, True),  # what moetext.generate.load decodes with
        ("dense", True, False),
    ],
)
def test_greedy_cached_decoding_equals_full_recompute(family, norm_topk_prob, prefused):
    model = _model(family, norm_topk_prob)
    reference = _model(family, norm_topk_prob)  # same seed: same weights, training layout
    if prefused:
        assert prefuse_all(model) == 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (5, 9, 3)]  # left-padded to 32
    out = generate_ids(
        model, prompts, max_new_tokens=6, eos_id=NEVER, return_logits=True, bucket=32
    )
    assert [len(t) for t in out.tokens] == [6, 6, 6] and out.logits is not None
    forward = jax.jit(lambda t: reference(t)[0])
    for b, prompt in enumerate(prompts):
        seq = prompt + out.tokens[b]
        full = np.asarray(forward(jnp.asarray([seq], jnp.int32)))[0]
        for i in range(6):
            want = full[len(prompt) + i - 1]  # the logits that chose new token i
            # float32 end to end; cached and full attention sum in different orders.
            np.testing.assert_allclose(out.logits[b, i], want, atol=1e-5, rtol=0)
            assert out.tokens[b][i] == int(np.argmax(want))


def test_eos_stops_a_row_and_batches_do_not_mix():
    model = _model()
    prompts = [[1, 2, 3, 4], [7, 7, 7, 7, 7, 7, 7]]
    free = generate_ids(model, prompts, max_new_tokens=8, eos_id=NEVER)
    eos = free.tokens[0][2]  # make row 0's third token its EOS
    out = generate_ids(model, prompts, max_new_tokens=8, eos_id=eos)
    assert out.tokens[0] == free.tokens[0][: free.tokens[0].index(eos)] and out.stopped_at_eos[0]
    # Each row alone gives the same tokens as in the batch (left padding hides the others).
    alone = generate_ids(model, [prompts[1]], max_new_tokens=8, eos_id=NEVER)
    assert alone.tokens[0] == free.tokens[1]


def test_sampling_is_reproducible_and_respects_top_k_and_top_p():
    model = _model()
    s = Sampling(temperature=0.8, top_k=5, top_p=0.9)
    a = generate_ids(model, [[1, 2, 3]], max_new_tokens=10, eos_id=NEVER, sampling=s, seed=7)
    b = generate_ids(model, [[1, 2, 3]], max_new_tokens=10, eos_id=NEVER, sampling=s, seed=7)
    c = generate_ids(model, [[1, 2, 3]], max_new_tokens=10, eos_id=NEVER, sampling=s, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0, 10.0]])
    keys = jax.random.split(jax.random.key(0), 200)
    top1 = {int(sample(logits, k, Sampling(temperature=1.0, top_k=1))[0]) for k in keys}
    assert top1 == {4}
    nucleus = {int(sample(logits, k, Sampling(temperature=1.0, top_p=0.5))[0]) for k in keys}
    assert nucleus == {4}  # token 4 alone holds > 0.99 of the mass
    # A high temperature flattens the distribution: top_k=3 still keeps exactly the top three.
    wide = {int(sample(logits, k, Sampling(temperature=100.0, top_k=3))[0]) for k in keys}
    assert wide == {2, 3, 4}


def test_bad_requests_fail_naming_the_value():
    model = _model()
    with pytest.raises(ConfigError, match=r"prompt 1 has 9 tokens; .* needs 13 .* --max_len 12"):
        generate_ids(model, [[1], [1] * 9], max_new_tokens=4, eos_id=NEVER, max_len=12)
    with pytest.raises(ConfigError, match="--temperature must be >= 0"):
        Sampling(temperature=-1)
    with pytest.raises(ConfigError, match=r"--top_p must be in \(0, 1\], got 1.5"):
        Sampling(top_p=1.5)
    with pytest.raises(ConfigError, match="--max_new_tokens must be >= 1"):
        generate_ids(model, [[1]], max_new_tokens=0, eos_id=NEVER)
