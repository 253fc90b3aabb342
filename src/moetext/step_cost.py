"""What a compiled TPU step costs, read from the compiler: FLOPs, HBM bytes, interconnect bytes,
and a roofline estimate of the step time from published per-chip peaks.

These are compiler-derived ESTIMATES, not timings. Nothing here ran on a TPU.

- `hlo_cost(hlo_text)` (moetext.hlo_cost): the FLOPs and HBM bytes the optimised HLO executes
  per step, every computation counted as often as it runs (layer scans, kernels' tile loops).
- `roofline(...)`: compute = FLOPs / peak, HBM = bytes / bandwidth, interconnect = the ring
  estimate of bytes each chip sends (hlo.collectives' `sent`) / the bandwidth of the two links
  a ring on one torus axis uses. Lower bound: everything overlaps, max(compute, HBM, ICI);
  upper bound: the interconnect exposed, max(compute, HBM) + ICI. MFU at each bound is the
  model FLOPs (models/flops.py) over peak x that time.

Chip figures (`CHIPS`) are Google Cloud's published per-chip numbers; docs/performance.md cites
the pages. On tpu7x (Ironwood) a JAX device is half a chip (one TensorCore of two): every "per
chip" figure in the report is per JAX device there, and the table halves the chip's peaks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from moetext import aot
from moetext.hlo_cost import hlo_cost


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published peaks of one TPU generation, per JAX device."""

    name: str
    bf16_flops_per_s: float
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float
    """One direction of one ICI link: the chip's published bidirectional ICI bandwidth / (2 x
    its ports), divided among the chip's JAX devices."""
    source: str


def _chip(name: str, tflops: float, hbm_gbps: float, ici_bidi_gbps: float, ports: int,
          devices: int, source: str) -> Chip:  # fmt: skip
    return Chip(
        name=name,
        bf16_flops_per_s=tflops * 1e12 / devices,
        hbm_bytes_per_s=hbm_gbps * 1e9 / devices,
        ici_link_bytes_per_s=ici_bidi_gbps * 1e9 / (2 * ports) / devices,
        source=source,
    )


# (bf16 TFLOP/s, HBM GB/s, bidirectional ICI GB/s per chip, ICI ports, JAX devices per chip).
# Google's pages differ (the v6e page gives 3584 Gbps = 448 GB/s of ICI, the TPU7x comparison
# table 800 GB/s bidirectional): the "bidirectional ICI bandwidth per chip" rows are used.
CHIPS: dict[str, Chip] = {
    "v5e": _chip("v5e", 197, 819, 400, 4, 1, "cloud.google.com/tpu/docs/v5e"),
    "v5p": _chip("v5p", 459, 2765, 1200, 6, 1, "cloud.google.com/tpu/docs/v5p"),
    "v6e": _chip("v6e", 918, 1640, 800, 4, 1, "cloud.google.com/tpu/docs/v6e, /tpu7x"),
    # Ironwood: 3D torus like v5p, 6 ports assumed (the page gives no port count); two devices.
    "tpu7x": _chip("tpu7x", 2307, 7380, 1200, 6, 2, "cloud.google.com/tpu/docs/tpu7x"),
}
CHIPS["v5litepod"] = CHIPS["v5e"]


def chip_of(topology: str) -> Chip:
    gen = topology.split(":")[0].split("-")[0]
    if gen not in CHIPS:
        raise aot.TopologyError(
            f"no published peaks for TPU generation {gen!r} in {topology!r}; known: {sorted(CHIPS)}"
        )
    return CHIPS[gen]


# --- the roofline ------------------------------------------------------------------------------


def roofline(
    *,
    chip: Chip,
    model_flops: float,
    compiled_flops: float,
    hbm_bytes_accessed: float,
    ici_bytes: float,
) -> dict[str, Any]:
    """Step-time bounds and MFU from per-device, per-step costs (see the module docstring)."""
    compute_s = compiled_flops / chip.bf16_flops_per_s
    hbm_s = hbm_bytes_accessed / chip.hbm_bytes_per_s
    # A ring along one torus axis sends both ways at once: two links' one-way bandwidth.
    ici_s = ici_bytes / (2 * chip.ici_link_bytes_per_s)
    low = max(compute_s, hbm_s, ici_s)
    high = max(compute_s, hbm_s) + ici_s
    terms = {"compute": compute_s, "hbm": hbm_s, "ici": ici_s}
    peak_work = chip.bf16_flops_per_s
    return {
        "chip": chip.name,
        "model_flops": model_flops,
        "compiled_flops": compiled_flops,
        "recompute_ratio": compiled_flops / model_flops if model_flops else math.nan,
        "hbm_bytes_accessed": hbm_bytes_accessed,
        "ici_bytes": ici_bytes,
        "compute_s": compute_s,
        "hbm_s": hbm_s,
        "ici_s": ici_s,
        "dominant": max(terms, key=lambda t: terms[t]),
        "step_s_low": low,
        "step_s_high": high,
        # MFU at each time bound: mfu_high at step_s_low (all overlapped), mfu_low at step_s_high.
        "mfu_high": model_flops / (peak_work * low) if low else math.nan,
        "mfu_low": model_flops / (peak_work * high) if high else math.nan,
    }


def step_cost(r: dict[str, Any], hlo_texts: Iterable[str]) -> dict[str, Any]:
    """The step-cost fields for an aot.report `r` of the programs whose optimised HLO is
    `hlo_texts` (one per program of the step), per device and per step."""
    costs = [hlo_cost(t) for t in hlo_texts]
    ici = sum(c["sent"] for c in r["collectives"])
    out = roofline(
        chip=chip_of(r["topology"]),
        model_flops=r["model_flops_per_chip"],
        compiled_flops=sum(c.flops for c in costs),
        hbm_bytes_accessed=sum(c.hbm_bytes for c in costs),
        ici_bytes=ici,
    )
    out["pallas_calls_without_estimate"] = sum(c.pallas_calls_without_estimate for c in costs)
    out["ici_bytes_by_op"] = _sent_by(r["collectives"], "op")
    # The mesh axes a collective's groups span ("fsdp", "data+fsdp"): which axis carries it.
    out["ici_bytes_by_axis"] = _sent_by(r.get("collectives_by_axis", []), "axes")
    return out


def decode_step_cost(r: dict[str, Any], hlo_text: str) -> dict[str, Any]:
    """The step cost of a compiled decode step (`aot.compiled_decode_step`'s report `r` and its
    optimised HLO), per device: compiled FLOPs, HBM bytes, interconnect bytes sent and the
    roofline bounds (no MFU: a decode step has no training FLOP count to hold it against)."""
    cost = hlo_cost(hlo_text)
    coll: list[dict[str, Any]] = r["collectives"]
    out = roofline(
        chip=chip_of(r["topology"]),
        model_flops=0.0,
        compiled_flops=cost.flops,
        hbm_bytes_accessed=cost.hbm_bytes,
        ici_bytes=sum(c["sent"] for c in coll),
    )
    for key in ("model_flops", "recompute_ratio", "mfu_high", "mfu_low"):
        del out[key]
    out["pallas_calls_without_estimate"] = cost.pallas_calls_without_estimate
    out["ici_bytes_by_op"] = _sent_by(coll, "op")
    return out


def _sent_by(collectives: list[dict[str, Any]], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in collectives:
        out[c[key]] = out.get(c[key], 0.0) + c["sent"]
    return out


def format_cost(c: dict[str, Any]) -> str:
    """The step-cost lines scripts/aot_compile.py prints with cost=true."""
    ms = 1e3
    by_op = ", ".join(f"{op} {b / 1e9:.3g} GB" for op, b in sorted(c["ici_bytes_by_op"].items()))
    by_axis = ", ".join(
        f"{ax} {b / 1e9:.3g} GB" for ax, b in sorted(c.get("ici_bytes_by_axis", {}).items())
    )
    lines = [
        f"step cost per device (compiler-derived estimates on {c['chip']} peaks, not timings):",
        f"  FLOPs: compiled {c['compiled_flops']:.4g}, model {c['model_flops']:.4g} "
        f"(ratio {c['recompute_ratio']:.3f}: remat and other recompute)",
        f"  HBM bytes accessed {c['hbm_bytes_accessed'] / 1e9:.4g} GB; interconnect sent "
        f"{c['ici_bytes'] / 1e9:.4g} GB ({by_op or 'none'})",
        f"  interconnect sent by mesh axes: {by_axis or 'none'}",
        f"  compute {c['compute_s'] * ms:.2f} ms, HBM {c['hbm_s'] * ms:.2f} ms, interconnect "
        f"{c['ici_s'] * ms:.2f} ms (dominant: {c['dominant']})",
        f"  step {c['step_s_low'] * ms:.2f} ms (all overlapped) to {c['step_s_high'] * ms:.2f} ms "
        f"(interconnect exposed); MFU {c['mfu_high']:.1%} to {c['mfu_low']:.1%}",
    ]
    if c["pallas_calls_without_estimate"]:
        lines.append(
            f"  {c['pallas_calls_without_estimate']} Pallas call(s) carry no cost estimate: "
            "their FLOPs are not counted"
        )
    return "\n".join(lines)
