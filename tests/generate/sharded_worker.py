"""The multi-device checks of test_sharded_decode.py: `python -m tests.generate.sharded_worker
CONVERTED_DIR`, on 4 fake CPU devices (tests/fake_devices.py).

Loads the converted checkpoint the way `moetext.generate.load` does (plan from the preset,
params restored straight onto its shardings, model merged from an abstract build), minus the
tokenizer, and decodes a batch of token-id prompts of different lengths greedily. One device is
the reference; each preset of RUNS then decodes on all 4 devices, twice:

- "params": as `python -m moetext.generate` runs today, only the params sharded (XLA
  propagates the rest);
- "rules": traced inside `plan.rules()` as the train step is, so every activation constraint
  applies and the MoE blocks take the sharded dispatch (`ep.layout_from_context`).

Prints one line `RESULT <json>`: "margin" (the reference's smallest top-1 minus top-2 logit gap
over all chosen tokens), "scale" (its largest |logit|), "ref" (its tokens), and per
"<run>/<mode>": "tokens", "logit_diff" (max |logits - reference logits|), "dispatches" (MoE
blocks traced through the sharded dispatch `ep.dropless`), "mesh", "layout" (the dispatch the
preset's rules pick), "shards" (one device's shapes of an expert and an attention weight); or
"error" (the exception's type and message) when the run raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import numpy as np
from flax import nnx

from moetext import checkpoint, config, models, program
from moetext.generate.decode import Generated, generate_ids
from moetext.models.moe import ep
from moetext.sharding.plan import Plan

DEVICES = 4
# f32 compute; the fixture's data.global_batch_size is checked against the device count.
BASE = ["model.dtype=float32", f"data.global_batch_size={DEVICES}"]
RUNS = {
    "fsdp": ["sharding.preset=fsdp"],  # fsdp=4
    "fsdp_ep": ["sharding.preset=fsdp_ep", "sharding.mesh.expert=2"],  # 4 experts over 2
    "fsdp_tp": ["sharding.preset=fsdp_tp", "sharding.mesh.tensor=2"],  # 4 heads, 2 kv heads
}
MODES = ("params", "rules")
# Token ids < vocab 96, lengths 5..11: left-padded into one 32-slot bucket. A batch of 4 splits
# over the 4 devices, as the sharded dispatch needs for the one-token decode steps.
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79], [50, 28, 8], [1] * 8]
MAX_NEW = 8
NEVER = 10**6  # an EOS id the model cannot produce: every row runs MAX_NEW steps


def load(ckpt: str, overrides: Sequence[str], devices: list[jax.Device]) -> tuple[Plan, Any]:
    """(plan, unscanned model holding the checkpoint's params on the plan's shardings)."""
    cfg = config.load(f"{ckpt}/config.yml", [*BASE, *overrides, "model.scan_layers=false"])
    plan = program.make_plan(cfg, devices)
    params = checkpoint.load_params(ckpt, cfg, program.params_target(cfg, plan))
    abstract = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    return plan, nnx.merge(graphdef, params, rest)


def decode(model: Any, plan: Plan | None) -> tuple[Generated, int]:
    """Greedy decoding of PROMPTS, traced inside `plan.rules()` when a plan is given; also how
    many MoE blocks were traced through the sharded dispatch (`ep.dropless`)."""
    calls = 0
    dropless = ep.dropless

    def counted(*args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        nonlocal calls
        calls += 1
        return dropless(*args, **kwargs)

    # jit does not key its cache on the logical rules: trace afresh for every run.
    jax.clear_caches()
    ep.dropless = counted
    try:
        with plan.rules() if plan is not None else contextlib.nullcontext():
            out = generate_ids(
                model, PROMPTS, max_new_tokens=MAX_NEW, eos_id=NEVER, return_logits=True
            )
    finally:
        ep.dropless = dropless
    return out, calls


def describe(plan: Plan, model: Any, num_experts: int) -> dict[str, Any]:
    """The mesh, the MoE dispatch the rules pick, and what one device holds of two weights."""
    with plan.rules():
        layout = ep.layout_from_context(num_experts)
    moe_layer = model.layers[1]  # layer 0 is dense (mlp_only_layers)

    def local(x: jax.Array) -> list[int]:
        return list(x.addressable_shards[0].data.shape)

    return {
        "mesh": dict(plan.mesh.shape),
        "layout": None
        if layout is None
        else {
            k: v
            for k, v in dataclasses.asdict(layout).items()
            if k in ("exp_axes", "num_shards", "token_axes")
        },
        "shards": {
            "w_gate": local(moe_layer.mlp.experts.w_gate[...]),
            "w_q": local(moe_layer.attn.w_q[...]),
        },
    }


def main() -> None:
    assert jax.device_count() == DEVICES, jax.devices()
    ckpt = sys.argv[1]
    _, single = load(ckpt, RUNS["fsdp"], jax.devices()[:1])
    ref, _ = decode(single, None)
    assert ref.logits is not None
    top2 = np.sort(ref.logits, axis=-1)[..., -2:]
    res: dict[str, Any] = {
        "ref": ref.tokens,
        "margin": float(np.min(top2[..., 1] - top2[..., 0])),
        "scale": float(np.max(np.abs(ref.logits))),
    }
    for name, overrides in RUNS.items():
        plan, model = load(ckpt, overrides, jax.devices())
        num_experts = model.layers[1].mlp.experts.w_gate.shape[0]
        for mode in MODES:
            key = f"{name}/{mode}"
            try:
                out, dispatches = decode(model, plan if mode == "rules" else None)
            except Exception as e:  # reported, not raised: the test names the failing runs
                res[key] = {"error": f"{type(e).__name__}: {e}"[:3000]}
                continue
            assert out.logits is not None
            res[key] = {
                "tokens": out.tokens,
                "logit_diff": float(np.max(np.abs(out.logits - ref.logits))),
                "dispatches": dispatches,
                **describe(plan, model, num_experts),
            }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
