"""Collectives and loops in XLA's optimised HLO text, counted per step.

The AOT report (`moetext.aot`) and the step-cost report (`moetext.step_cost`) read compiled
programs as text: `call_multipliers` gives each computation's runs per step (a while body
runs its trip count per run of its caller: the layer scan, the kernels' tile loops), and
`collectives` counts every collective with the bytes each chip sends by a ring estimate,
keyed by element type, result shape, or the mesh axes its device groups span (`by="axis"`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

DTYPE_BYTES: dict[str, float] = {
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
ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALL_RE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
# Computation lists: a conditional's branches, an async op's wrapped computations.
_CALL_LIST_RE = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
_PARTITIONS_RE = re.compile(r"num_partitions=(\d+)")
# Replica groups as XLA prints them (group_members): over named mesh axes, as an iota list
# [groups..., size]<=[dims]T(perm), or explicit {{a,b},{c,d}}; a permute's source_target_pairs.
_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_FULL_RE = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_LIST_FULL_RE = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)+)\}")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")
# Bytes each chip sends per result byte, by collective, for ring algorithms over a group of g
# chips: all-gather (g-1)/g of its result, reduce-scatter g-1 times its (1/g-size) result,
# all-reduce twice (g-1)/g (a reduce-scatter, then an all-gather). An estimate that compares
# collective forms (an all-reduce moves twice a reduce-scatter's bytes), not a wire count.
_SENT_PER_RESULT_BYTE = {
    "all-gather": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: g - 1.0,
    "all-reduce": lambda g: 2 * (g - 1) / g,
    # per byte of the full-size all-reduce inside the fusion: a reduce-scatter of that input
    "all-reduce-scatter": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    # per byte it sends at most (_ragged_bytes): (g-1)/g of it leaves the chip when every
    # destination gets its share; a bound on the data-dependent count
    "ragged-all-to-all": lambda g: (g - 1) / g,
}


# --- instructions -----------------------------------------------------------------------------

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_ARRAY_SHAPE_RE = re.compile(r"[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?")
_OP_AFTER_SHAPE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")


class Instr(NamedTuple):
    """One instruction line: `name = shape op(rest`."""

    name: str
    shape: str  # the result shape with its layout; a tuple's in parentheses
    op: str
    rest: str  # what follows "op(": the operands, ")", then the attributes


def parse_instr(line: str) -> Instr | None:
    """The instruction a line defines, or None (a computation header, a brace, a comment)."""
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    shape, after = split_shape(line[m.end() :])
    op = _OP_AFTER_SHAPE_RE.match(after) if shape else None
    if op is None:
        return None
    return Instr(m.group(1), shape, op.group(1), after[op.end() :])


def split_shape(rest: str) -> tuple[str, str]:
    """(the result shape text, what follows it) of an instruction's right-hand side."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :]
    m = _ARRAY_SHAPE_RE.match(rest)
    if not m:
        return "", rest
    return m.group(0), rest[m.end() :]


_OPERAND_RE = re.compile(
    r"(?:(?P<shape>[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+)?%(?P<name>[\w.\-]+)(?:#(?P<i>\d+))?"
)


def _operand_matches(rest: str) -> list[re.Match[str]]:
    """The operands inside an instruction's parentheses (`Instr.rest`), each a %name, with its
    shape printed before it in XLA's dumps, and `#i` for element i of a tuple-shaped value."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return list(_OPERAND_RE.finditer(rest[:end]))


def _operand_name(m: re.Match[str]) -> str:
    return f"{m['name']}#{m['i']}" if m["i"] else m["name"]


def operands(rest: str) -> list[str]:
    """Operand names of an instruction (`Instr.rest`), `name#i` for a tuple's element i."""
    return [_operand_name(m) for m in _operand_matches(rest)]


def operand_shapes(rest: str, shapes: Mapping[str, str]) -> list[str]:
    """Operand shapes of an instruction: as printed before them, else by name from `shapes`
    (its module's definitions; "" when unknown)."""
    return [m["shape"] or shape_of(shapes, _operand_name(m)) for m in _operand_matches(rest)]


def tuple_elements(shape: str) -> list[str]:
    """The top-level element shapes of a tuple shape text (commas inside an element's dims,
    layout or nested tuple do not split it)."""
    inner, parts, depth, start = shape[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return [re.sub(r"/\*.*?\*/", "", p).strip() for p in parts]


def shape_of(shapes: Mapping[str, str], operand: str) -> str:
    """An operand's shape text ("" when unknown), `name#i` being element i of a tuple."""
    name, _, index = operand.partition("#")
    shape = shapes.get(name, "")
    if index and shape.startswith("("):
        elements = tuple_elements(shape)
        return elements[int(index)] if int(index) < len(elements) else ""
    return shape


def module_of_lines(lines: list[str]) -> list[int]:
    """The index of the module each line belongs to: a step's text may join several modules
    (aot.hlo_text joins its programs), each opening with an `HloModule` line; lines before the
    first such line, or a text without one, are module 0."""
    out: list[int] = []
    module = -1
    for line in lines:
        if line.startswith("HloModule") or module < 0:
            module += 1
        out.append(module)
    return out


def module_defs(lines: list[str]) -> list[dict[str, str]]:
    """Per module of the text (`module_of_lines`), instruction name -> result shape: names are
    unique within a module, not across modules."""
    modules = module_of_lines(lines)
    out: list[dict[str, str]] = [{} for _ in range(max(modules, default=0) + 1)]
    for line, module in zip(lines, modules, strict=True):
        ins = parse_instr(line)
        if ins is not None:
            out[module][ins.name] = ins.shape
    return out


def _ragged_bytes(
    line: str, shapes: Mapping[str, str], nbytes: float, dtypes: list[str]
) -> tuple[float, list[str], float]:
    """(receive-buffer bytes, its element types, bytes of the rows it sends at most) of a ragged
    all-to-all line, its first two operands (the rows to send, the receive buffer) resolved by
    name in `shapes` (its module's). A shard sends at most its first operand and, summed over a
    balanced step, about what its buffer receives: the smaller of the two (the way back sends
    from a receive buffer of up to P times the rows it returns). Falls back to the result's
    bytes for both when an operand cannot be resolved."""
    ins = parse_instr(line)
    args = operand_shapes(ins.rest, shapes) if ins else []
    send, recv = args[:2] if len(args) > 1 else ("", "")
    if not send or not recv:
        return nbytes, dtypes, nbytes
    recv_bytes, recv_dtypes = array_bytes(recv)
    return recv_bytes, recv_dtypes, min(array_bytes(send)[0], recv_bytes)


def custom_call_operands(text: str, name: str) -> dict[tuple[int, str], list[str]]:
    """For each custom call whose line contains `name` (a Pallas kernel's name), keyed by
    (module index, instruction name) (a step's text may join several modules), its operands'
    result shapes with their layouts, in order: `S(1)` in a layout is VMEM, none is HBM."""
    lines = text.splitlines()
    defs = module_defs(lines)
    out: dict[tuple[int, str], list[str]] = {}
    for line, module in zip(lines, module_of_lines(lines), strict=True):
        if name not in line or (ins := parse_instr(line)) is None or ins.op != "custom-call":
            continue
        out[(module, ins.name)] = [sh or "?" for sh in operand_shapes(ins.rest, defs[module])]
    return out


def array_bytes(shape_text: str) -> tuple[float, list[str]]:
    """Bytes of an HLO result shape such as bf16[128,2048]{1,0} or a tuple of them."""
    total, dtypes = 0.0, []
    for dtype, dims in ARRAY_RE.findall(shape_text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES.get(dtype, 4)
        dtypes.append(dtype)
    return total, dtypes


def call_multipliers(lines: list[str]) -> tuple[list[str | None], dict[str, int]]:
    """Computation of each line, and how often each computation runs per step: a while body
    runs trip-count times per run of its caller; fusions, async wrappers and each branch of a
    conditional (an upper bound: one of them runs) as often as their callers."""
    comp_of_line: list[str | None] = []
    current: str | None = None
    body_of: dict[str | None, list[str]] = defaultdict(list)
    for line in lines:
        m = _COMP_RE.match(line.strip())
        if m:
            current = m.group(1)
        comp_of_line.append(current)
        body_of[current].append(line)
    callers: dict[str, list[tuple[str | None, int]]] = defaultdict(list)
    for line, comp in zip(lines, comp_of_line, strict=True):
        for key, callee in _CALL_RE.findall(line):
            n = _trip_count(line, body_of) if key == "body" else 1
            callers[callee].append((comp, n))
        for _, names in _CALL_LIST_RE.findall(line):
            # Every branch of a conditional counted as run (an upper bound: one runs).
            for callee in re.findall(r"%?([\w.\-]+)", names):
                callers[callee].append((comp, 1))

    memo: dict[str, int] = {}

    def times(comp: str | None, depth: int = 0) -> int:
        if comp is None or comp not in callers or depth > 64:
            return 1  # ENTRY (or a computation nothing calls)
        if comp not in memo:
            memo[comp] = sum(times(c, depth + 1) * n for c, n in callers[comp])
        return memo[comp]

    return comp_of_line, {c: times(c) for c in set(comp_of_line) if c is not None}


_INT_CONST_RE = re.compile(r"%?([\w.\-]+)\s*=\s*[su](?:8|16|32|64)\[\][^ ]*\s+constant\((\d+)\)")


def _trip_count(while_line: str, body_of: dict[str | None, list[str]]) -> int:
    """known_trip_count when XLA recorded it, else, for a loop whose condition is `counter <
    bound` (one integer constant), ceil(bound / step): the step is what the body adds to that
    counter (1 if the text does not show it); loops count from 0. Scan loops step by 1;
    XLA:TPU's windowed-einsum loops (a collective matmul's steps) count in u32, often by 2 (two
    chunks per trip, one per direction), and record no known_trip_count. 1 for any other
    condition (counted once)."""
    t = _TRIP_RE.search(while_line)
    if t:
        return int(t.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", while_line)
    cond_lines = body_of.get(cond.group(1) if cond else None, [])
    consts = {m.group(1): int(m.group(2)) for ln in cond_lines if (m := _INT_CONST_RE.search(ln))}
    cmp = re.search(r"compare\(([^)]*)\).*?direction=(\w+)", _root(cond_lines))
    if len(consts) != 1 or not cmp or cmp.group(2) != "LT":
        return 1
    names = re.findall(r"%([\w.\-]+(?:#\d+)?)", cmp.group(1))
    if len(names) != 2 or names[1] not in consts:
        return 1
    index = _tuple_index(names[0], cond_lines)
    body = re.search(r"body=%?([\w.\-]+)", while_line)
    body_lines = body_of.get(body.group(1) if body else None, [])
    step = 1 if index is None else _counter_step(index, body_lines)
    return max(1, -(-consts[names[1]] // step))


def _root(comp_lines: list[str]) -> str:
    """A computation's ROOT line ("" if none)."""
    return next((line for line in comp_lines if line.lstrip().startswith("ROOT ")), "")


def _tuple_index(name: str, cond_lines: list[str]) -> int | None:
    """Which element of the loop's tuple a condition operand is: `%param#k` (XLA's dump form),
    or a get-tuple-element(..., index=k) of the parameter; None otherwise."""
    if "#" in name:
        return int(name.rsplit("#", 1)[1])
    for line in cond_lines:
        d = re.match(r"\s*%?([\w.\-]+)\s*=.*\bget-tuple-element\(.*?index=(\d+)", line)
        if d and d.group(1) == name:
            return int(d.group(2))
    return None


def _counter_step(index: int, body_lines: list[str]) -> int:
    """What a while body adds per trip to element `index` of the loop tuple: that element of
    the body's ROOT tuple as add(counter, constant). 1 when the text does not show it."""
    args = re.search(r"\btuple\((.*)\)", _root(body_lines))
    names = re.findall(r"%([\w.\-]+)", args.group(1)) if args else []
    if index >= len(names):
        return 1
    consts = {
        m.group(1): int(m.group(2)) for line in body_lines if (m := _INT_CONST_RE.search(line))
    }
    for line in body_lines:
        m = re.match(r"\s*%?([\w.\-]+)\s*=\s*\S+\s+add\(([^)]*)\)", line)
        if m and m.group(1) == names[index]:
            steps = [consts[o] for o in re.findall(r"%([\w.\-]+)", m.group(2)) if o in consts]
            return steps[0] if len(steps) == 1 and steps[0] > 0 else 1
    return 1


def group_size(line: str, partitions: int) -> int:
    """The size of a collective's replica groups, read from its HLO line (all `partitions`
    devices when it lists none)."""
    return len(group_members(line, partitions)[0])


def group_members(line: str, partitions: int) -> list[list[int]]:
    """A collective's device groups (partition ids), read from its HLO line: replica groups as
    an iota list or explicit, a permute's source-target pairs (each pair a group), all
    `partitions` devices when it lists none."""
    m = _IOTA_FULL_RE.search(line)
    if m:
        size = int(m.group(1).split(",")[-1])  # [groups..., size]: the last dim is one group
        dims = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return [[int(x) for x in row] for row in ids.reshape(-1, size)]
    m = _LIST_FULL_RE.search(line) or _PAIRS_RE.search(line)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))
        ]
    m = _MESH_GROUPS_RE.search(line)
    if m:  # Shardy's form: groups along the named axes of a mesh over devices 0..n-1 in order
        sizes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        ids = np.arange(math.prod(n for _, n in sizes)).reshape([n for _, n in sizes] or [1])
        named = [i for i, (a, _) in enumerate(sizes) if a in re.findall(r"'([^']+)'", m.group(2))]
        rest = [i for i in range(len(sizes)) if i not in named]
        size = math.prod(sizes[i][1] for i in named)
        return [[int(x) for x in g] for g in ids.transpose(rest + named).reshape(-1, size)]
    return [list(range(partitions))]


def group_axes(line: str, partitions: int, mesh_shape: Mapping[str, int]) -> str:
    """The mesh axes a collective's device groups span, "+"-joined in mesh order ("fsdp",
    "data+fsdp"): the axes along which a group's members' mesh coordinates differ, a partition
    id p being the device at flat index p of the mesh's devices (jit's device assignment). The
    named-mesh form counts as its device groups too: XLA also names meshes of its own
    ('axis_0').
    "-" for a collective within one device, "?" for groups that do not fit the mesh."""
    names, shape = list(mesh_shape), [int(n) for n in mesh_shape.values()]
    if math.prod(shape) != partitions or "device_ids=[" in line:  # an order not read here
        return "?"
    varying: set[int] = set()
    for group in group_members(line, partitions):
        if any(not 0 <= d < partitions for d in group):
            return "?"
        coords = np.array(np.unravel_index(group, shape)).T if group else np.zeros((0, 0))
        varying |= {a for a in range(len(shape)) if len(coords) and len(set(coords[:, a])) > 1}
    return "+".join(names[a] for a in sorted(varying)) or "-"


def collectives(
    hlo_text: str, *, by: str = "dtype", mesh_shape: Mapping[str, int] | None = None
) -> dict[tuple[str, str], dict[str, float]]:
    """(op, element types) -> count, bytes (of the results) and sent (bytes each chip sends, a
    ring-algorithm estimate: _SENT_PER_RESULT_BYTE; the result bytes for a permute; for a ragged
    all-to-all, bytes = its receive buffer and sent = (g-1)/g of the rows it sends) per step;
    ops inside a while body (the layer scan), or in computations it calls, count once per
    known trip. by="shape" keys on the result shape instead (e.g.
    f8e4m3fn[8,2048,768]: which arrays cross the wire); by="axis" on the mesh axes the
    op's device groups span (`group_axes` over `mesh_shape`, the compiled program's mesh)."""
    if by == "axis" and mesh_shape is None:
        raise ValueError('collectives(by="axis") needs the mesh_shape of the compiled program')
    lines = hlo_text.splitlines()
    comp_of_line, times = call_multipliers(lines)
    parts = _PARTITIONS_RE.search(hlo_text)
    partitions = int(parts.group(1)) if parts else 1
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(
        lambda: {"count": 0, "bytes": 0.0, "sent": 0.0}
    )
    # Per module (`module_of_lines`), instruction name -> result shape, built on demand.
    defs: list[dict[str, str]] | None = None
    for line, comp, module in zip(lines, comp_of_line, module_of_lines(lines), strict=True):
        m = _OP_RE.search(line)
        if not m or "-done(" in line:
            continue
        nbytes, dtypes = array_bytes(m.group("shape"))
        op = m.group("op")
        sent_base = nbytes
        if op == "ragged-all-to-all":
            if defs is None:
                defs = module_defs(lines)
            # Bytes: the receive buffer (its result, however the op's tuple prints); sent: the
            # rows it sends (_ragged_bytes).
            nbytes, dtypes, sent_base = _ragged_bytes(line, defs[module], nbytes, dtypes)
        if op == "all-reduce" and comp is not None and comp.startswith("all-reduce-scatter"):
            # XLA:TPU's fused form of a reduce-scatter: an all-reduce and a dynamic-slice in a
            # computation of this name, run by the same emitter as its reduce-scatter ops
            # ("SingleInputAllReduceScatterFusion", a ring): a reduce-scatter on the wire.
            op = "all-reduce-scatter"
        if by == "shape":
            shapes = [f"{dt}[{dims}]" for dt, dims in ARRAY_RE.findall(m.group("shape"))]
            key = (op, ",".join(shapes))
        elif by == "axis":
            assert mesh_shape is not None
            key = (op, group_axes(line, partitions, mesh_shape))
        else:
            key = (op, ",".join(sorted(set(dtypes))))
        k = times.get(comp, 1) if comp is not None else 1
        per_byte = _SENT_PER_RESULT_BYTE.get(op)
        sent = sent_base * (per_byte(group_size(line, partitions)) if per_byte else 1.0)
        out[key]["count"] += k
        out[key]["bytes"] += k * nbytes
        out[key]["sent"] += k * sent
    return dict(out)
