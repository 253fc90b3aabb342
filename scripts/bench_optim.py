"""The optimizer update's speed on this machine: moetext's AdamW (optim.build) against the same
chain with optax's own global-norm clip, on a config's real parameter tree.

Both are jitted `params, opt_state <- update(grads)` with the params and state donated, as the
trainer's update program is; the gradients are random normal (scaled so that the clip acts,
as it does early in a run), the same for both. The timed calls alternate, and the ratio is the
median over --reps (optax, moetext) pairs, so it survives a loaded machine better than the
absolute ms do. Both results are checked to agree (the clip's scalar scale against optax's
per-element division: float32 rounding apart, 1e-5 relative on the params after one update).

    python scripts/bench_optim.py configs/models/bench-tiny-moe.yml [--reps 20] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import moetext.models  # noqa: F401  (registers the model families before config.load)
from moetext import config as config_lib
from moetext import optim
from moetext.program import build


def jitted_update(tx: optax.GradientTransformation) -> Any:
    def update(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(update, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--reps", type=int, default=20, help="timed (optax, moetext) pairs")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: expected at least 1")
    cfg = config_lib.load(args.config, [*args.overrides, "checkpoint.enabled=false"])
    params = build(cfg).state.params
    leaves = jax.tree.leaves(params)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(
        lambda p: jnp.asarray(rng.standard_normal(p.shape) * 0.01, p.dtype), params
    )
    steps = cfg.train.steps
    arms = {
        "optax": optim.adamw(cfg.optim, steps, clip=optax.clip_by_global_norm),
        "moetext": optim.build(cfg.optim, steps),
    }
    fns = {k: jitted_update(tx) for k, tx in arms.items()}
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    states = {k: (copy(params), tx.init(params)) for k, tx in arms.items()}
    for k in fns:  # compile, warm up, and check the two agree after one update
        states[k] = fns[k](*states[k], grads)
    jax.block_until_ready(states)
    for a, b in zip(*(jax.tree.leaves(states[k][0]) for k in fns), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.reps):
        for k in fns:
            t0 = time.perf_counter()
            states[k] = fns[k](*states[k], grads)
            jax.block_until_ready(states[k])
            times[k].append(time.perf_counter() - t0)
    n = sum(x.size for x in leaves)
    ratio = statistics.median(m / o for m, o in zip(times["moetext"], times["optax"], strict=True))
    print(f"{args.config}: {len(leaves)} param leaves, {n / 1e6:.1f}M params, {args.reps} pairs")
    for k, ts in times.items():
        print(f"  {k:8s} update {statistics.median(ts) * 1e3:8.2f} ms (median)")
    print(f"  moetext / optax: {ratio:.3f} (median of per-pair ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
