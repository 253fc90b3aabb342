"""What a compiled TPU step costs, read from the compiler: FLOPs, HBM bytes, interconnect bytes,
and a roofline estimate of the step time from published per-chip peaks.

These are compiler-derived ESTIMATES, not timings. Nothing here ran on a TPU.

- `hlo_cost(hlo_text)`: the FLOPs and HBM bytes the optimised HLO executes per step. XLA's own
  cost analysis counts a while body once, and pod configs scan their layers, so this walks the
  HLO itself and multiplies every computation by how often it runs (the trip counts of
  hlo.call_multipliers, as the collectives count does): FLOPs of every dot and convolution
  (2 x result elements x contracted elements) plus each Pallas call's own `pl.CostEstimate`
  (MaxText's kernels carry none: their useful FLOPs from their shapes, `_kernel_flops`);
  HBM bytes as XLA's cost analysis defines them (each top-level instruction reads its operands
  and writes its result; a fusion's internals stay on chip).
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

import collections
import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from moetext import aot, hlo


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


# --- FLOPs and HBM bytes of optimised HLO --------------------------------------------------------

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP_AFTER_SHAPE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
_FUSION_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_TO_APPLY_RE = re.compile(r"\bto_apply=%?([\w.\-]+)")
_CONTRACT_RE = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS_RE = re.compile(r"dim_labels=([\w]+)_([\w]+)->([\w]+)")
_FEATURE_GROUPS_RE = re.compile(r"feature_group_count=(\d+)")
_CE_FLOPS_RE = re.compile(r'cost_estimate\\?"\s*:\s*\{\\?"flops\\?"\s*:\s*\\?"?(\d+)')
# Instructions that move no HBM bytes of their own (XLA's cost analysis gives them none, or
# their bytes are counted in the computations they call).
_NO_BYTES = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "call",
        "conditional",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "copy-done",
        "all-gather-done",
        "all-reduce-done",
        "collective-permute-done",
        "async-done",
        "send-done",
        "recv-done",
    }
)


def _split_shape(rest: str) -> tuple[str, str]:
    """(the result shape text, what follows it) of an instruction's right-hand side."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :]
    m = re.match(r"[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?", rest)
    if not m:
        return "", rest
    return m.group(0), rest[m.end() :]


def _operands(after_op: str) -> list[str]:
    """Operand names of an instruction: the %names inside its first parentheses."""
    depth, end = 1, len(after_op)
    for i, ch in enumerate(after_op):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    # name#i is element i of a tuple-shaped value (XLA prints get-tuple-element so).
    return [
        f"{n}#{i}" if i else n for n, i in re.findall(r"%([\w.\-]+)(?:#(\d+))?", after_op[:end])
    ]


def _tuple_elements(shape: str) -> list[str]:
    """The top-level element shapes of a tuple shape text."""
    inner, parts, depth, start = shape[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return [re.sub(r"/\*.*?\*/", "", p).strip() for p in parts]


def _shape_of(shapes: dict[str, str], operand: str) -> str:
    name, _, index = operand.partition("#")
    shape = shapes.get(name, "")
    if index and shape.startswith("("):
        elements = _tuple_elements(shape)
        return elements[int(index)] if int(index) < len(elements) else ""
    return shape


def _dims(shape_text: str) -> list[int]:
    m = hlo.ARRAY_RE.search(shape_text)
    if not m or not m.group(2):
        return []
    return [int(d) for d in m.group(2).split(",")]


def _dot_flops(result: str, lhs: str, attrs: str) -> float:
    contract = _CONTRACT_RE.search(attrs)
    lhs_dims = _dims(lhs)
    k = math.prod(lhs_dims[int(i)] for i in contract.group(1).split(",") if i) if contract else 1
    return 2.0 * math.prod(_dims(result)) * k


def _window(attrs: str) -> dict[str, list[list[int]]]:
    """The window attribute's fields (size, stride, pad, lhs_dilate, rhs_dilate), each a list
    over the spatial dims (pad: [low, high] pairs)."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    out: dict[str, list[list[int]]] = {}
    for key, value in re.findall(r"(\w+)=([0-9_x\-]+)", m.group(1) if m else ""):
        out[key] = [[int(v) for v in d.split("_")] for d in value.split("x")]
    return out


def _valid_pairs(n: int, m: int, w: int, stride: int, pad_low: int, lhs_dil: int,
                 rhs_dil: int) -> int:  # fmt: skip
    """(output position, window tap) pairs of one spatial dim that land on a real input element
    (not padding, not a dilation hole): what a convolution computes along that dim. XLA:TPU
    writes a dot's batch dims as such dims (window n, padding n - 1): one tap per output."""
    hi = (n - 1) * lhs_dil
    count = 0
    for o in range(m):
        for k in range(w):
            pos = o * stride + k * rhs_dil - pad_low
            if 0 <= pos <= hi and pos % lhs_dil == 0:
                count += 1
    return count


def _conv_flops(result: str, lhs: str, attrs: str) -> float:
    """2 x output batch x output features x input features per group x, per spatial dim, the
    output/tap pairs on real input (XLA's HloCostAnalysis counts convolutions the same way)."""
    labels = _DIM_LABELS_RE.search(attrs)
    lhs_dims, out_dims = _dims(lhs), _dims(result)
    if not labels or len(lhs_dims) != len(labels.group(1)) or len(out_dims) != len(labels.group(3)):
        return 2.0 * math.prod(out_dims)  # shapes not read: at least one MAC per output
    lhs_l, _, out_l = labels.groups()
    groups = _FEATURE_GROUPS_RE.search(attrs)
    in_features = lhs_dims[lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
    flops = 2.0 * out_dims[out_l.index("b")] * out_dims[out_l.index("f")] * in_features
    win = _window(attrs)
    for d in sorted(c for c in out_l if c.isdigit()):
        i = int(d)

        def field(key: str, default: int, i: int = i) -> int:
            return win[key][i][0] if key in win and i < len(win[key]) else default

        flops *= _valid_pairs(
            n=lhs_dims[lhs_l.index(d)],
            m=out_dims[out_l.index(d)],
            w=field("size", 1),
            stride=field("stride", 1),
            pad_low=field("pad", 0),
            lhs_dil=field("lhs_dilate", 1),
            rhs_dil=field("rhs_dilate", 1),
        )
    return flops


_LAYOUTS_RE = re.compile(r"operand_layout_constraints=\{(.*?)\}, \w+=")
# Attention kernels by their Pallas name: matmul FLOPs per (head x query x key x head dim) of
# the forward (QK^T and PV), the dq pass (QK^T, dP, dQ) and the dk/dv pass (QK^T, dP, dV, dK).
_SPLASH = {"fwd": 4, "dq": 6, "dkv": 8}
# Causal masking computes about half the score blocks (plus the diagonal, ignored here).
CAUSAL_FRACTION = 0.5


def _kernel_flops(ins: _Instr) -> float | None:
    """Useful FLOPs of a Pallas call that carries no pl.CostEstimate (MaxText's megablox gmm and
    splash attention), from its name and operand shapes: gmm 2 M K N, tgmm 2 M K N, splash
    attention by _SPLASH at CAUSAL_FRACTION. None for a kernel it does not know."""
    layouts = _LAYOUTS_RE.search(ins.line)
    ops = [
        [int(d) for d in dims.split(",") if d]
        for _, dims in hlo.ARRAY_RE.findall(layouts.group(1) if layouts else "")
    ]
    out = _dims(ins.shape)
    name = ins.name.split(".")[0]
    two = [o for o in ops if len(o) == 2 and o[0] > 1]
    three = [o for o in ops if len(o) == 3]
    if name.startswith("gmm") and len(out) == 2 and three:
        e_k_n = three[-1]
        k = e_k_n[1] if e_k_n[2] == out[1] else e_k_n[2]
        return 2.0 * out[0] * k * out[1]
    if name.startswith("tgmm") and len(out) == 3 and two:
        return 2.0 * two[0][0] * out[1] * out[2]
    if name.startswith("splash_mha"):
        kind = next((v for key, v in _SPLASH.items() if f"_{key}_" in name), None)
        qkv = [o for o in three if o[-1] <= 256]  # [heads, seq, head_dim]
        if kind is None or len(qkv) < 2:
            return None
        q, kk = max(qkv, key=lambda o: o[0]), qkv[-1]
        return kind * q[0] * q[1] * kk[1] * q[2] * CAUSAL_FRACTION
    return None


@dataclasses.dataclass(frozen=True)
class HloCost:
    flops: float
    """Dot and convolution FLOPs, plus Pallas calls' cost estimates, per step."""
    hbm_bytes: float
    """Bytes read and written by top-level instructions (fusions as units), per step."""
    top_bytes: tuple[tuple[str, float], ...]
    """The largest HBM movers: (op name and result shape, bytes per step), largest first."""
    pallas_calls_without_estimate: int
    """Pallas calls whose FLOPs are unknown (no pl.CostEstimate, no shape rule in
    _kernel_flops): counted as 0."""


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    line: str


@dataclasses.dataclass
class _Comp:
    params: dict[int, str] = dataclasses.field(default_factory=dict)
    instrs: dict[str, _Instr] = dataclasses.field(default_factory=dict)
    users: dict[str, list[_Instr]] = dataclasses.field(default_factory=dict)
    root: str | None = None


def _parse(
    lines: list[str], comp_of_line: list[str | None]
) -> tuple[dict[str, _Comp], list[_Instr | None]]:
    comps: dict[str, _Comp] = {}
    out: list[_Instr | None] = []
    for line, comp in zip(lines, comp_of_line, strict=True):
        m = _INSTR_RE.match(line)
        shape, after = _split_shape(line[m.end() :]) if m else ("", "")
        op = _OP_AFTER_SHAPE_RE.match(after) if shape else None
        if m is None or op is None or comp is None:
            out.append(None)
            continue
        rest = after[op.end() :]
        ins = _Instr(m.group(1), shape, op.group(1), _operands(rest), line)
        c = comps.setdefault(comp, _Comp())
        c.instrs[ins.name] = ins
        if ins.op == "parameter":
            c.params[int(re.match(r"\s*(\d+)", rest).group(1))] = ins.name  # type: ignore[union-attr]
        for o in ins.operands:
            c.users.setdefault(o, []).append(ins)
        if line.lstrip().startswith("ROOT"):
            c.root = ins.name
        out.append(ins)
    return comps, out


def _param_read(
    comps: dict[str, _Comp], comp: str, index: int, full: float, depth: int = 0
) -> float:
    """Bytes a fused computation reads of its parameter `index` (full size `full`): only the
    slices when every use is a dynamic-slice of it, nothing when it is the buffer a
    dynamic-update-slice writes into in place (XLA's cost analysis does the same)."""
    c = comps.get(comp)
    name = c.params.get(index) if c else None
    if c is None or name is None or depth > 16:
        return full
    read = 0.0
    for u in c.users.get(name, []):
        if u.op == "dynamic-slice" and u.operands[0] == name:
            read += hlo.array_bytes(u.shape)[0]
        elif u.op == "dynamic-update-slice" and u.operands[0] == name:
            continue
        elif u.op == "bitcast" and u.operands == [name]:  # a view: what its users read
            c.params[-1 - depth] = u.name
            read += _param_read(comps, comp, -1 - depth, full, depth + 1)
        elif u.op == "fusion" and (callee := _FUSION_CALLS_RE.search(u.line)):
            for j, o in enumerate(u.operands):
                if o == name:
                    read += _param_read(comps, callee.group(1), j, full, depth + 1)
        else:
            return full
    return min(read, full)


def _written(comps: dict[str, _Comp], comp: str, shape: str) -> float:
    """Bytes a fusion writes: its result, but only the update of a dynamic-update-slice (in
    place) among its root's outputs."""
    c = comps.get(comp)
    root = c.instrs.get(c.root) if c and c.root else None
    if c is None or root is None:
        return hlo.array_bytes(shape)[0]
    outs = [c.instrs.get(o) for o in root.operands] if root.op == "tuple" else [root]
    total = 0.0
    for o in outs:
        if o is None:
            continue
        if o.op == "dynamic-update-slice" and len(o.operands) > 1:
            update = c.instrs.get(o.operands[1])
            total += hlo.array_bytes(update.shape)[0] if update else hlo.array_bytes(o.shape)[0]
        else:
            total += hlo.array_bytes(o.shape)[0]
    return total


def hlo_cost(hlo_text: str) -> HloCost:
    """FLOPs and HBM bytes of optimised HLO per step: each computation counted as often as it
    runs (while bodies trip-count times, fusions as often as their callers). Text holding
    several modules (the programs of a step, one after another) is their sum."""
    modules = re.split(r"\n(?=HloModule )", hlo_text)
    if len(modules) > 1:
        costs = [_module_cost(m) for m in modules]
        top = sorted((kv for c in costs for kv in c.top_bytes), key=lambda kv: -kv[1])[:10]
        return HloCost(
            flops=sum(c.flops for c in costs),
            hbm_bytes=sum(c.hbm_bytes for c in costs),
            top_bytes=tuple(top),
            pallas_calls_without_estimate=sum(c.pallas_calls_without_estimate for c in costs),
        )
    return _module_cost(hlo_text)


def _module_cost(hlo_text: str) -> HloCost:
    """hlo_cost of one HLO module (instruction names are unique within a module)."""
    lines = hlo_text.splitlines()
    comp_of_line, times = hlo.call_multipliers(lines)
    comps, parsed = _parse(lines, comp_of_line)
    shapes = {i.name: i.shape for c in comps.values() for i in c.instrs.values()}
    inner: set[str] = set()  # fused and applied computations: their bytes stay on chip
    for p in parsed:
        if p is not None and p.op == "fusion":
            inner.update(_FUSION_CALLS_RE.findall(p.line))
        if p is not None:
            inner.update(_TO_APPLY_RE.findall(p.line))
    flops = hbm = 0.0
    missing = 0
    movers: dict[str, float] = collections.defaultdict(float)
    for comp, ins in zip(comp_of_line, parsed, strict=True):
        if ins is None:
            continue
        k = times.get(comp, 1) if comp is not None else 1
        lhs = _shape_of(shapes, ins.operands[0]) if ins.operands else ""
        if ins.op == "dot":
            flops += k * _dot_flops(ins.shape, lhs, ins.line)
        elif ins.op == "convolution":
            flops += k * _conv_flops(ins.shape, lhs, ins.line)
        elif ins.op == "custom-call" and "tpu_custom_call" in ins.line:
            ce = _CE_FLOPS_RE.search(ins.line)
            known = float(ce.group(1)) if ce else _kernel_flops(ins)
            if known is None:
                missing += k
            else:
                flops += k * known
        if comp in inner or ins.op in _NO_BYTES:
            continue
        callee = _FUSION_CALLS_RE.search(ins.line) if ins.op == "fusion" else None
        if callee:
            moved = _written(comps, callee.group(1), ins.shape) + sum(
                _param_read(comps, callee.group(1), j, hlo.array_bytes(_shape_of(shapes, o))[0])
                for j, o in enumerate(ins.operands)
            )
        elif ins.op == "copy-start" and ins.operands:  # reads its operand, writes one copy
            moved = 2 * hlo.array_bytes(_shape_of(shapes, ins.operands[0]))[0]
        elif ins.op in ("dynamic-slice", "slice"):  # reads the slice, writes it
            moved = 2 * hlo.array_bytes(ins.shape)[0]
        elif ins.op == "dynamic-update-slice" and len(ins.operands) > 1:  # in place
            moved = 2 * hlo.array_bytes(_shape_of(shapes, ins.operands[1]))[0]
        else:
            moved = hlo.array_bytes(ins.shape)[0] + sum(
                hlo.array_bytes(_shape_of(shapes, o))[0] for o in ins.operands
            )
        hbm += k * moved
        movers[f"{ins.op} {ins.name} {re.sub(r'[{].*', '', ins.shape)} x{k}"] += k * moved
    top = tuple(sorted(movers.items(), key=lambda kv: -kv[1])[:10])
    return HloCost(flops=flops, hbm_bytes=hbm, top_bytes=top, pallas_calls_without_estimate=missing)


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
