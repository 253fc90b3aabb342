"""FLOPs and HBM bytes of a compiled program's optimised HLO, per step (`hlo_cost`).

XLA's own cost analysis counts a while body once, and pod configs scan their layers, so this
walks the HLO itself and multiplies every computation by how often it runs (the trip counts of
hlo.call_multipliers, as the collectives count does): FLOPs of every dot and convolution
(2 x result elements x contracted elements; convolutions by their taps on real input) plus each
Pallas call's own `pl.CostEstimate` (kernels without one, MaxText's and jax's splash attention:
their useful FLOPs from their shapes, `_kernel_flops`); HBM bytes as XLA's cost analysis
defines them (each top-level instruction reads its operands and writes its result; a fusion's
internals stay on chip; a Pallas call at most its `pl.CostEstimate`'s bytes_accessed).
`moetext.step_cost` turns them into a roofline.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from moetext import hlo

_FUSION_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_TO_APPLY_RE = re.compile(r"\bto_apply=%?([\w.\-]+)")
_CONTRACT_RE = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS_RE = re.compile(r"dim_labels=([\w]+)_([\w]+)->([\w]+)")
_FEATURE_GROUPS_RE = re.compile(r"feature_group_count=(\d+)")
_CE_FLOPS_RE = re.compile(r'cost_estimate\\?"\s*:\s*\{\\?"flops\\?"\s*:\s*\\?"?(\d+)')
_CE_BYTES_RE = re.compile(r'cost_estimate\\?"\s*:\s*\{[^}]*?bytes_accessed\\?"\s*:\s*\\?"?(\d+)')
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
        "slice-done",
        "all-gather-done",
        "all-reduce-done",
        "collective-permute-done",
        "async-done",
        # An async call's steps (XLA:TPU offloads gathers, scatters and, on TPU7x, collectives
        # to the SparseCore this way): its bytes are counted once, at its call-start. XLA's
        # dumps print the same op as async-start / async-update / async-done.
        "call-update",
        "async-update",
        "call-done",
        "send-done",
        "recv-done",
    }
)


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
        p = hlo.parse_instr(line)
        if p is None or comp is None:
            out.append(None)
            continue
        ins = _Instr(p.name, p.shape, p.op, hlo.operands(p.rest), line)
        c = comps.setdefault(comp, _Comp())
        c.instrs[ins.name] = ins
        if ins.op == "parameter":
            c.params[int(re.match(r"\s*(\d+)", p.rest).group(1))] = ins.name  # type: ignore[union-attr]
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
    if c is None or name is None or depth > 16 or name == c.root:
        return full  # unknown, too deep, or the fusion's result is (a view of) all of it
    read = 0.0
    for u in c.users.get(name, []):
        if u.op == "dynamic-slice" and u.operands[0] == name:
            read += hlo.array_bytes(u.shape)[0]
        elif u.op == "dynamic-update-slice" and u.operands[0] == name:
            continue
        elif u.operands == [name] and (
            u.op == "bitcast" or (u.op == "fusion" and _is_relayout(comps, u))
        ):
            # A view: what its users read. A nested copy fusion that only re-tiles the
            # parameter is one too (XLA:TPU, e.g. the scan's stacked residuals [L, ...] read one
            # layer at a time): emitted inside this fusion's loop, it reads no more than that.
            c.params[-1 - depth] = u.name
            read += _param_read(comps, comp, -1 - depth, full, depth + 1)
        elif u.op == "fusion" and (callee := _FUSION_CALLS_RE.search(u.line)):
            for j, o in enumerate(u.operands):
                if o == name:
                    read += _param_read(comps, callee.group(1), j, full, depth + 1)
        else:
            return full
    return min(read, full)


def _unlaid(shape: str) -> str:
    """An HLO shape's element type and dims, without its layout."""
    return re.sub(r"[{].*", "", shape)


def _is_relayout(comps: dict[str, _Comp], fusion: _Instr) -> bool:
    """Whether a fusion computes param -> copy / bitcast -> ROOT of the same element type and
    shape: a layout change only."""
    callee = _FUSION_CALLS_RE.search(fusion.line)
    c = comps.get(callee.group(1)) if callee else None
    src = c.instrs.get(c.params.get(0, "")) if c else None
    if c is None or src is None:
        return False
    body = [i for i in c.instrs.values() if i.op != "parameter"]
    same = _unlaid(fusion.shape) == _unlaid(src.shape)
    return same and bool(body) and all(i.op in ("copy", "bitcast") for i in body)


def _signature_bytes(comps: dict[str, _Comp], comp: str) -> float:
    """Bytes of a computation's parameters and result: what an async call of it moves."""
    c = comps.get(comp)
    if c is None:
        return 0.0
    # Indices >= 0 only: _param_read files its bitcast views under negative ones.
    names = [n for i, n in c.params.items() if i >= 0 and n in c.instrs]
    params = sum(hlo.array_bytes(c.instrs[n].shape)[0] for n in names)
    root = c.instrs.get(c.root) if c.root else None
    return params + (hlo.array_bytes(root.shape)[0] if root else 0.0)


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
        # Fused computations, and an async-start's wrapped one (counted at the start, below).
        if p is not None and p.op in ("fusion", "async-start"):
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
        lhs = hlo.shape_of(shapes, ins.operands[0]) if ins.operands else ""
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
        if comp in inner or ins.op in _NO_BYTES or 'custom_call_target="ConcatBitcast"' in ins.line:
            continue  # ConcatBitcast: XLA:TPU's view of prefetched chunks as one buffer
        callee = _FUSION_CALLS_RE.search(ins.line) if ins.op == "fusion" else None
        if callee:
            moved = _written(comps, callee.group(1), ins.shape) + sum(
                _param_read(comps, callee.group(1), j, hlo.array_bytes(hlo.shape_of(shapes, o))[0])
                for j, o in enumerate(ins.operands)
            )
        elif ins.op == "copy-start" and ins.operands:  # reads its operand, writes one copy
            moved = 2 * hlo.array_bytes(hlo.shape_of(shapes, ins.operands[0]))[0]
        elif ins.op in ("dynamic-slice", "slice"):  # reads the slice, writes it
            moved = 2 * hlo.array_bytes(ins.shape)[0]
        elif (ins.op == "call-start" and (applied := _TO_APPLY_RE.search(ins.line))) or (
            ins.op == "async-start" and (applied := _FUSION_CALLS_RE.search(ins.line))
        ):
            # The wrapped computation reads its parameters and writes its result, once.
            moved = _signature_bytes(comps, applied.group(1))
        elif ins.op == "slice-start" and ins.shape.startswith("("):
            # Async slice ((operand), slice, context): reads and writes the slice only (XLA:TPU
            # prefetches a weight into VMEM in such chunks), not the whole operand per chunk.
            elements = hlo.tuple_elements(ins.shape)
            moved = 2 * hlo.array_bytes(elements[1] if len(elements) > 1 else "")[0]
        elif ins.op == "dynamic-update-slice" and len(ins.operands) > 1:  # in place
            moved = 2 * hlo.array_bytes(hlo.shape_of(shapes, ins.operands[1]))[0]
        else:
            moved = hlo.array_bytes(ins.shape)[0] + sum(
                hlo.array_bytes(hlo.shape_of(shapes, o))[0] for o in ins.operands
            )
            if ins.op == "custom-call" and (ce := _CE_BYTES_RE.search(ins.line)):
                # A Pallas call whose estimate reads less than its whole operands (the fused
                # MoE decode kernel: the active experts' blocks of [E, ...] weights).
                moved = min(moved, float(ce.group(1)))
        hbm += k * moved
        movers[f"{ins.op} {ins.name} {_unlaid(ins.shape)} x{k}"] += k * moved
    top = tuple(sorted(movers.items(), key=lambda kv: -kv[1])[:10])
    return HloCost(flops=flops, hbm_bytes=hbm, top_bytes=top, pallas_calls_without_estimate=missing)
