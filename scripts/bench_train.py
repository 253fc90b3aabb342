"""Training throughput of a config: tokens/s and MFU against this machine's dense bf16 peak.

    .venv/bin/python scripts/bench_train.py configs/models/bench-tiny-moe.yml [key=value ...]
        [--steps 20] [--warmup 3] [--out bench.json]
        [--arm NAME key=value ...]... [--maxtext] [--rounds 3]

The baseline (dense bf16 matmul FLOP/s) is measured in the same process; MFU is
flops_per_token * tokens/s over that peak (models/flops.py has the FLOP convention).

Comparisons in one process: each `--arm NAME key=value ...` is the same config with more
overrides (the first arm, "this", has none); `--maxtext` adds the arm MaxText's CPU path
corresponds to (`kernels.gmm_backend=ragged_dot model.loss_chunk_size=0`: XLA's ragged_dot,
logits then cross-entropy). Every arm is compiled and warmed up first, then the timed steps
alternate: `--rounds` rounds of `--steps` steps per arm, in arm order. Each arm reports the
median of all its steps, and "x this" = its median step time over this arm's (> 1 is slower);
"cpu x this" the same ratio of CPU time per step (steadier on a shared host), and the per-round
ratios show the spread.

An arm's `env:VAR=VALUE` items set an environment variable while that arm traces and compiles,
then restore it: for the settings moetext reads at trace time, such as the CPU dot forms of
kernels/host_dots.py (`--arm native env:MOETEXT_CPU_GMM_DOTS=native`). Settings read once per
process (XLA_FLAGS) cannot differ between arms.

Like the trainer's entry point it has glibc reuse XLA:CPU's freed host buffers
(moetext/host_memory.py; `MOETEXT_REUSE_HOST_MEMORY=0` for glibc's defaults, a setting of the
process: compare it across processes); each arm also reports its kernel (system) time and minor
page faults per step, and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import config as config_lib
from moetext import data as data_lib
from moetext import host_memory
from moetext.models.flops import flops_per_token
from moetext.program import build, jit_train_step, lower_checked, put_batch
from moetext.train import peak as peak_lib

# As the trainer's entry point does (src/train.py): time the step the trainer runs.
host_memory.reuse_freed_memory()

MAXTEXT = ["kernels.gmm_backend=ragged_dot", "model.loss_chunk_size=0"]
ENV_ITEM = "env:"  # an arm item that sets an environment variable while the arm compiles


def split_env(items: list[str]) -> tuple[dict[str, str], list[str]]:
    """An arm's items as (environment variables, config overrides)."""
    env: dict[str, str] = {}
    overrides = []
    for item in items:
        if not item.startswith(ENV_ITEM):
            overrides.append(item)
            continue
        var, eq, value = item.removeprefix(ENV_ITEM).partition("=")
        if not var or not eq:
            raise SystemExit(f"bench_train: {item!r} must be env:VAR=VALUE")
        env[var] = value
    return env, overrides


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ inside the block; every variable restored (or unset) after."""
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


@dataclasses.dataclass
class Arm:
    """One config's compiled train step, its state and batches, and the step times so far."""

    name: str
    overrides: list[str]
    cfg: config_lib.Config
    step: Any
    state: Any
    batches: list[dict[str, jax.Array]]
    compile_s: float
    env: dict[str, str]  # set while this arm compiled (env:VAR=VALUE items)
    times: list[float] = dataclasses.field(default_factory=list)
    cpu_times: list[float] = dataclasses.field(default_factory=list)
    sys_times: list[float] = dataclasses.field(default_factory=list)
    page_faults: list[int] = dataclasses.field(default_factory=list)
    loss: float = float("nan")

    def run(self, steps: int, timed: bool) -> None:
        for i in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            self.state, m = self.step(self.state, self.batches[i % len(self.batches)])
            jax.block_until_ready(m)
            if timed:
                self.times.append(time.perf_counter() - t0)
                self.cpu_times.append(time.process_time() - c0)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                self.sys_times.append(r1.ru_stime - r0.ru_stime)
                self.page_faults.append(r1.ru_minflt - r0.ru_minflt)
        self.loss = float(m["loss"])


def prepare(name: str, path: str, overrides: list[str], env: dict[str, str]) -> Arm:
    """Arm `name`: the config with `overrides`, compiled with `env` set (`environment`)."""
    cfg = config_lib.load(path, [*overrides, "checkpoint.enabled=false"])
    b = build(cfg)
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    # The trainer's own jitted step (plan shardings pinned), traced under the logical rules.
    step = jit_train_step(b)
    batches = [put_batch(data.next_batch(), b.batch_sharding) for _ in range(4)]
    data.close()
    t0 = time.perf_counter()
    with environment(env):
        compiled = lower_checked(b, step, b.state, batches[0]).compile()
    return Arm(name, overrides, cfg, compiled, b.state, batches, time.perf_counter() - t0, env)


def report(arm: Arm, path: str, peak: peak_lib.Peak) -> dict[str, Any]:
    cfg = arm.cfg
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    dt = float(np.median(arm.times))
    fpt = flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
    n = jax.device_count()
    return {
        "arm": arm.name,
        "config": path,
        "overrides": arm.overrides,
        "env": arm.env,
        "backend": cfg.kernels.gmm_backend,
        "loss_chunk_size": cfg.model.loss_chunk_size,
        "devices": n,
        "platform": jax.default_backend(),
        "tokens_per_step": tokens,
        "compile_s": arm.compile_s,
        "steps_timed": len(arm.times),
        "step_time_s_median": dt,
        "step_time_s_min": float(np.min(arm.times)),
        # CPU seconds of this process per step (all threads): on a host shared with other jobs
        # it moves less than wall time, since waiting for a core costs no CPU time.
        "step_cpu_s_median": float(np.median(arm.cpu_times)),
        # Of which the kernel's (mapping and zeroing fresh pages, moetext/host_memory.py), and
        # the minor page faults per step.
        "step_sys_s_median": float(np.median(arm.sys_times)),
        "page_faults_per_step_median": float(np.median(arm.page_faults)),
        "host_memory_reuse": host_memory.reuse_freed_memory(),
        # The process's peak resident memory so far (all arms: read it from a one-arm run).
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "tokens_per_s": tokens / dt,
        "model_tflops_per_s": fpt * tokens / dt / 1e12,
        "mfu": peak.mfu(fpt * tokens / dt / n),
        "dense_bf16_peak_tflops_per_device": peak.flops / 1e12,
        "peak_source": peak.source,
        "flops_per_token": fpt,
        "final_loss": arm.loss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=20, help="timed steps (per arm and round)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
    p.add_argument("--out", help="write the result (a list with one entry per arm) as JSON here")
    p.add_argument(
        "--arm",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="another arm: the same config and overrides plus these, and env:VAR=VALUE items "
        "(repeatable)",
    )
    p.add_argument(
        "--maxtext", action="store_true", help="add the arm maxtext: " + " ".join(MAXTEXT)
    )
    p.add_argument("--rounds", type=int, default=1, help="alternations of the arms' timed steps")
    args = p.parse_args()

    specs = [("this", list(args.overrides))]
    specs += [(name, [*args.overrides, *extra]) for name, *extra in args.arm]
    if args.maxtext:
        specs.append(("maxtext", [*args.overrides, *MAXTEXT]))
    # Every arm's items parsed first: a malformed env item fails before anything compiles.
    parsed = [(name, split_env(items)) for name, items in specs]
    arms = [prepare(name, args.config, overrides, env) for name, (env, overrides) in parsed]
    for arm in arms:
        arm.run(args.warmup, timed=False)
    for _ in range(args.rounds):
        for arm in arms:
            arm.run(args.steps, timed=True)

    peak = peak_lib.select(None)  # published for TPU/H100/H200, else measured
    results = [report(arm, args.config, peak) for arm in arms]
    for result in results:
        if len(results) > 1:
            print(f"--- arm {result['arm']}")
        for k, v in result.items():
            print(f"{k:>36}: {v:.4g}" if isinstance(v, float) else f"{k:>36}: {v}")
    if len(arms) > 1:
        print(
            f"\n{'arm':<12}{'step s':>9}{'tokens/s':>10}{'x this':>8}{'cpu x this':>11}"
            "  x this per round"
        )
        for arm, r in zip(arms, results, strict=True):
            rounds = [
                np.median(arm.times[i : i + args.steps])
                / np.median(arms[0].times[i : i + args.steps])
                for i in range(0, len(arm.times), args.steps)
            ]
            r["x_this"] = r["step_time_s_median"] / results[0]["step_time_s_median"]
            r["x_this_per_round"] = [float(x) for x in rounds]
            r["cpu_x_this"] = r["step_cpu_s_median"] / results[0]["step_cpu_s_median"]
            print(
                f"{r['arm']:<12}{r['step_time_s_median']:>9.4f}{r['tokens_per_s']:>10.0f}"
                f"{r['x_this']:>8.3f}{r['cpu_x_this']:>11.3f}  "
                f"{' '.join(f'{x:.3f}' for x in rounds)}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=1)


if __name__ == "__main__":
    main()
