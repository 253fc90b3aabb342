"""Ahead-of-time compile of the real train step for a TPU topology; per-chip memory and traffic.

    .venv/bin/python scripts/aot_compile.py configs/models/qwen3-30b-a3b.yml topology=v5p:4x4x2 \\
        sharding.preset=fsdp data.global_batch_size=32 kernels.gmm_backend=ragged_dot

No TPU is needed: libtpu describes the topology's devices, the mesh and shardings come from
the run's sharding preset, and the step is traced under its logical rules exactly as in
training. Prints per-chip memory (arguments, temporaries, outputs vs the chip's HBM), FLOPs per
chip and the collectives of the compiled HLO; exits 1 when the step does not fit in HBM.
Extra options: json=PATH writes the numbers, hlo=PATH writes the optimised HLO text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# Only describes a topology, never opens a TPU: don't contend for libtpu's one-process lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import jax  # noqa: E402

import moetext  # noqa: E402,F401  (platform defaults before jax is imported)
from moetext.models.flops import flops_per_token  # noqa: E402
from moetext.train import loop  # noqa: E402
from moetext.train.step import abstract_batch  # noqa: E402

GiB = 1024**3
# HBM per chip, GiB, by the topology name's generation prefix.
HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32, "tpu7x": 192}
DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "ragged-all-to-all",
    "all-to-all",
    "collective-permute",
)
_OP_RE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALL_RE = re.compile(r"\b(body|condition|calls|to_apply|called_computations)=\{?%?([\w.\-]+)")
_TRIP_RE = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')


def parse_args(argv: list[str]) -> tuple[str, str, dict[str, str], list[str]]:
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        raise SystemExit(__doc__)
    options, overrides = {}, []
    for item in argv[1:]:
        key = item.split("=", 1)[0]
        if key in ("topology", "json", "hlo"):
            options[key] = item.split("=", 1)[1]
        else:
            overrides.append(item)
    if "topology" not in options:
        raise SystemExit("missing topology=NAME, e.g. topology=v5p:4x4x2")
    return argv[0], options["topology"], options, overrides


def hbm_bytes(topology: str) -> int:
    gen = topology.split(":")[0].split("-")[0]
    if gen not in HBM_GIB:
        raise SystemExit(
            f"unknown TPU generation {gen!r} in {topology!r}; known: {sorted(HBM_GIB)}"
        )
    return HBM_GIB[gen] * GiB


def array_bytes(shape_text: str) -> tuple[float, list[str]]:
    """Bytes of an HLO result shape such as bf16[128,2048]{1,0} or a tuple of them."""
    total, dtypes = 0.0, []
    for dtype, dims in _ARRAY_RE.findall(shape_text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES.get(dtype, 4)
        dtypes.append(dtype)
    return total, dtypes


def _call_multipliers(lines: list[str]) -> tuple[list[str | None], dict[str, int]]:
    """Computation of each line, and how often each computation runs per step: a while body
    runs trip-count times per run of its caller; fusions and async wrappers as often as
    their callers."""
    comp_of_line, current = [], None
    body_of: dict[str | None, list[str]] = defaultdict(list)
    for line in lines:
        m = _COMP_RE.match(line.strip())
        if m:
            current = m.group(1)
        comp_of_line.append(current)
        body_of[current].append(line)
    callers = defaultdict(list)
    for line, comp in zip(lines, comp_of_line, strict=True):
        for key, callee in _CALL_RE.findall(line):
            n = _trip_count(line, body_of) if key == "body" else 1
            callers[callee].append((comp, n))

    memo: dict[str, int] = {}

    def times(comp: str | None, depth: int = 0) -> int:
        if comp not in callers or depth > 64:
            return 1  # ENTRY (or a computation nothing calls)
        if comp not in memo:
            memo[comp] = sum(times(c, depth + 1) * n for c, n in callers[comp])
        return memo[comp]

    return comp_of_line, {c: times(c) for c in set(comp_of_line) if c is not None}


def _trip_count(while_line: str, body_of: dict) -> int:
    """known_trip_count when XLA recorded it, else the loop bound: the one integer constant in
    the condition computation (scan loops count from 0 while i < n)."""
    t = _TRIP_RE.search(while_line)
    if t:
        return int(t.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", while_line)
    consts = [
        int(c.group(1))
        for line in body_of.get(cond.group(1) if cond else None, [])
        if (c := re.search(r"=\s*s(?:32|64)\[\][^ ]*\s+constant\((\d+)\)", line))
    ]
    return consts[0] if len(consts) == 1 else 1


def collectives(hlo_text: str, *, by: str = "dtype") -> dict[tuple[str, str], dict[str, float]]:
    """(op, element types) -> count and bytes per step; ops inside a while body (the layer
    scan), or in computations it calls, count once per known trip. by="shape" keys on the
    result shape instead (e.g. f8e4m3fn[8,2048,768]: which arrays cross the wire)."""
    lines = hlo_text.splitlines()
    comp_of_line, times = _call_multipliers(lines)
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0})
    for line, comp in zip(lines, comp_of_line, strict=True):
        m = _OP_RE.search(line)
        if not m or "-done(" in line:
            continue
        nbytes, dtypes = array_bytes(m.group("shape"))
        if by == "shape":
            shapes = [f"{dt}[{dims}]" for dt, dims in _ARRAY_RE.findall(m.group("shape"))]
            key = (m.group("op"), ",".join(shapes))
        else:
            key = (m.group("op"), ",".join(sorted(set(dtypes))))
        k = times.get(comp, 1)
        out[key]["count"] += k
        out[key]["bytes"] += k * nbytes
    return dict(out)


def compile_step(cfg, devices):

    b = loop.build(cfg, devices, abstract=True)
    batch = abstract_batch(cfg.data.global_batch_size, cfg.data.seq_len, b.batch_sharding)
    t0 = time.perf_counter()
    lowered = loop.lower_checked(b, loop.jit_train_step(b), b.state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return b, compiled, t1 - t0, time.perf_counter() - t1


def report(cfg, topology: str, b, compiled, lower_s: float, compile_s: float) -> dict:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    args, temps = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    outs, alias = mem.output_size_in_bytes, mem.alias_size_in_bytes
    # Donated state: outputs that alias arguments take no extra memory.
    total = args + temps + outs - alias
    hbm = hbm_bytes(topology)
    chips = b.mesh.devices.size
    tokens_per_chip = cfg.data.global_batch_size * cfg.data.seq_len / chips
    hlo = compiled.as_text()
    coll = collectives(hlo)
    by_shape = sorted(collectives(hlo, by="shape").items(), key=lambda kv: -kv[1]["bytes"])
    return {
        "topology": topology,
        "chips": chips,
        "mesh": dict(b.mesh.shape),
        "preset": b.plan.preset.name,
        "global_batch_size": cfg.data.global_batch_size,
        "seq_len": cfg.data.seq_len,
        "tokens_per_chip": tokens_per_chip,
        "arguments_bytes": args,
        "temporaries_bytes": temps,
        "outputs_bytes": outs,
        "alias_bytes": alias,
        "total_bytes": total,
        "hbm_bytes": hbm,
        "fits": total <= hbm,
        # XLA's cost analysis counts a while body once: the layer scan's FLOPs appear once.
        "xla_flops_per_chip": float(cost.get("flops", float("nan"))) if cost else float("nan"),
        # Model FLOPs (6N + attention, no remat recompute): what MFU is measured against.
        "model_flops_per_chip": flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
        * tokens_per_chip,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "collectives": [
            {"op": op, "dtypes": dt, "count": v["count"], "bytes": v["bytes"]}
            for (op, dt), v in sorted(coll.items())
        ],
        "collectives_by_shape": [
            {"op": op, "shapes": sh, "count": v["count"], "bytes": v["bytes"]}
            for (op, sh), v in by_shape
        ],
    }


def print_report(r: dict) -> None:
    g = lambda n: f"{n / GiB:8.2f} GiB"
    print(f"topology {r['topology']}: {r['chips']} chips, mesh {r['mesh']}, preset {r['preset']}")
    print(
        f"batch {r['global_batch_size']} x {r['seq_len']} = {r['tokens_per_chip']:.0f} "
        f"tokens per chip; lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s"
    )
    print("memory per chip:")
    for key in ("arguments", "temporaries", "outputs", "alias"):
        print(f"  {key:<12}{g(r[key + '_bytes'])}")
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    print(f"  {'total':<12}{g(r['total_bytes'])} of {g(r['hbm_bytes']).strip()} HBM: {verdict}")
    print(
        f"FLOPs per chip per step: model {r['model_flops_per_chip']:.4g} (6N + attention); "
        f"XLA cost analysis {r['xla_flops_per_chip']:.4g} (scan body counted once)"
    )
    print("collectives per step (ops in the layer scan counted once per layer):")
    for c in r["collectives"]:
        print(f"  {c['op']:<20}{c['dtypes']:<12}{c['count']:>6} x  {g(c['bytes'])} total")
    print("largest collectives by result shape:")
    for c in r["collectives_by_shape"][:8]:
        print(f"  {c['op']:<20}{c['shapes']:<32}{c['count']:>6} x  {g(c['bytes'])} total")


def main(argv: list[str]) -> int:
    path, topology, options, overrides = parse_args(argv)
    from jax.experimental import topologies

    from moetext import config

    cfg = config.load(path, overrides)
    if cfg.kernels.gmm_backend == "auto":  # "auto" would pick for this host's CPU, not the TPU
        from moetext.kernels.gmm import auto_backend_name

        tpu = dataclasses.replace(cfg.kernels, gmm_backend=auto_backend_name("tpu"))
        cfg = cfg.replace(kernels=tpu)
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    try:
        b, compiled, lower_s, compile_s = compile_step(cfg, devices)
    except jax.errors.JaxRuntimeError as e:
        # XLA refuses to finish compiling a program whose buffers exceed HBM: that is the
        # answer "does not fit", with XLA's own numbers.
        if "RESOURCE_EXHAUSTED" not in str(e) and "HbmOom" not in str(e):
            raise
        print(f"topology {topology}: DOES NOT FIT: {str(e).splitlines()[0]}")
        if "json" in options:
            Path(options["json"]).write_text(json.dumps({"fits": False, "error": str(e)}))
        return 1
    r = report(cfg, topology, b, compiled, lower_s, compile_s)
    print_report(r)
    if "json" in options:
        Path(options["json"]).write_text(json.dumps(r, indent=1))
    if "hlo" in options:
        Path(options["hlo"]).write_text(compiled.as_text())
    return 0 if r["fits"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
