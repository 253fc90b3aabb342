"""What an expert-parallel receive bound (`moe.ep_buffer_factor`) would drop, from a routing trace.

    .venv/bin/python scripts/ep_bound.py RUN_DIR/routing_trace --num_experts 128 \
        --expert_shards 8 --token_shards 256 [--bounds 1.0,1.1,1.25,1.5]

Reads every step_<n>.npz a run wrote with `train.routing_trace=[start,stop]` (key layer_<i>:
int32 [B, S, K] global expert ids of the step's batch) and prints, per layer and over all
layers, the fraction of assignments each bound would drop (`ep_exchange.bound_drops`: the
same counts and bound as the training step's exchange), and the smallest bound that drops
nothing in any traced step. --token_shards is the number of devices the batch is split over
(data x fsdp x expert under fsdp_ep), --expert_shards the expert axis. One micro-batch per
step is assumed (train.grad_accum_steps=1): with N micro-batches pass --micro_batches N, and
each is dispatched on its own as the step does (rows i, N + i, ... of the batch).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from moetext.models.moe import ep_exchange


def min_bound(ids_TK: np.ndarray, num_experts: int, expert_shards: int, token_shards: int) -> float:
    """The smallest factor whose receive buffer holds every shard's rows (before the 8-row
    rounding): the busiest receiver's rows over a shard's m."""
    t, k = ids_TK.shape
    p = expert_shards
    m = t // token_shards * k
    dest = ids_TK.reshape(token_shards // p, p * m) // (num_experts // p)
    busiest = max(int(np.bincount(g, minlength=p).max()) for g in dest)
    return busiest / m


def micro_batches(ids_BSK: np.ndarray, n: int) -> list[np.ndarray]:
    """The step's micro-batches as the train step splits the batch (rows i, n + i, ...)."""
    return [ids_BSK[i::n] for i in range(n)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir", help="RUN_DIR/routing_trace (step_<n>.npz files)")
    p.add_argument("--num_experts", type=int, required=True)
    p.add_argument("--expert_shards", type=int, required=True, help="sharding.mesh.expert")
    p.add_argument("--token_shards", type=int, required=True, help="devices splitting the batch")
    p.add_argument("--bounds", default="1.0,1.1,1.25,1.5,2.0", help="comma-separated factors")
    p.add_argument("--micro_batches", type=int, default=1, help="train.grad_accum_steps")
    a = p.parse_args(argv)
    bounds = [float(b) for b in a.bounds.split(",")]
    if any(b <= 0 for b in bounds):
        p.error(f"--bounds {a.bounds}: every bound must be > 0 (0 is the dropless exchange)")
    steps = sorted(Path(a.trace_dir).glob("step_*.npz"))
    if not steps:
        p.error(f"no step_<n>.npz in {a.trace_dir!r}: run with train.routing_trace=[start,stop]")
    dropped: dict[tuple[str, float], list[int]] = {}
    worst: dict[str, float] = {}
    for path in steps:
        with np.load(path) as npz:
            layers = sorted(npz.files, key=lambda n: int(re.sub(r"\D", "", n) or 0))
            for layer in layers:
                for ids in micro_batches(npz[layer], a.micro_batches):
                    ids_TK = ids.reshape(-1, ids.shape[-1])
                    try:  # bound_drops checks that the shards split the tokens
                        for b in bounds:
                            d, n = ep_exchange.bound_drops(
                                ids_TK, a.num_experts, a.expert_shards, a.token_shards, b
                            )
                            acc = dropped.setdefault((layer, b), [0, 0])
                            acc[0], acc[1] = acc[0] + d, acc[1] + n
                    except ValueError as e:
                        p.error(f"{path.name} {layer} {ids.shape}: {e}")
                    need = min_bound(ids_TK, a.num_experts, a.expert_shards, a.token_shards)
                    worst[layer] = max(worst.get(layer, 0.0), need)
    names = sorted(worst, key=lambda n: int(re.sub(r"\D", "", n) or 0))
    print(f"{len(steps)} traced steps, {len(names)} MoE layers; fraction of assignments dropped")
    print(
        "layer       "
        + "".join(f"{'bound ' + format(b, 'g'):>12}" for b in bounds)
        + "  no drops at"
    )
    for layer in [*names, "all"]:
        cells = []
        for b in bounds:
            pairs = [dropped[(n, b)] for n in names] if layer == "all" else [dropped[(layer, b)]]
            cells.append(sum(d for d, _ in pairs) / sum(n for _, n in pairs))
        need = max(worst.values()) if layer == "all" else worst[layer]
        print(f"{layer:<12}" + "".join(f"{c:>12.4f}" for c in cells) + f"  {need:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
