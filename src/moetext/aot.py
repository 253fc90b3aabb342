"""Ahead-of-time compilation for TPU topologies: per-chip memory, FLOPs and collectives.

No TPU is needed. libtpu describes a topology's chips (`tpu_devices`, the one place this
project asks it), the mesh and shardings come from the run's sharding preset, and the real
train step is traced under its logical rules exactly as in training (`compile_step`).
`report` reads the compiled programs (the gradient and the update under train.separate_update,
`programs`): XLA's memory analysis against the chip's HBM (the larger program's), XLA's and the
model's FLOPs per chip, and the collectives of the optimised HLO counted per step
(`collectives`: ops inside the layer scan's while body count once per trip).

scripts/aot_compile.py is the command line over this module; the benchmarks and the TPU
tests take their devices from `tpu_devices`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from moetext import hlo
from moetext.kernels.pallas import target as pallas_target

if TYPE_CHECKING:
    from moetext.config import Config
    from moetext.program import Built

GiB = 1024**3
# HBM per JAX device, GiB, by the topology name's generation prefix: a chip's, except tpu7x
# (Ironwood), whose chip shows JAX two devices (one per TensorCore, `core_on_chip` 0 and 1) with
# half of its 192 GiB each.
HBM_GIB: dict[str, float] = {
    "v4": 32,
    "v5e": 16,
    "v5litepod": 16,
    "v5p": 95,
    "v6e": 32,
    "tpu7x": 96,
}
# A small topology per chip generation (the chip names of kernels/gmm/tiling.py): what the
# kernel tests and benchmarks compile one chip of.
TOPOLOGY_BY_CHIP = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1", "tpu7x": "tpu7x:2x2x1"}


class TopologyError(ValueError):
    """A TPU topology this process cannot describe: a name libtpu rejects, a generation with no
    known HBM size, or no libtpu installed."""


# --- the topology ------------------------------------------------------------------------------


def tpu_devices(topology: str) -> list[jax.Device]:
    """The chips of a libtpu topology such as "v5p:2x2x1", as compile-only devices.

    Nothing is opened: the devices only describe the chips, so a CPU-only machine with libtpu
    installed can lower and compile for them (shardings, `jax.jit(...).lower(...).compile()`).
    """
    # Describing a topology never opens a TPU: don't contend for libtpu's one-process lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    examples = ", ".join(TOPOLOGY_BY_CHIP.values())
    expected = f"a libtpu topology name GENERATION:SHAPE, e.g. {examples}"
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except jax.errors.JaxRuntimeError as e:
        if "INVALID_ARGUMENT" not in str(e):
            raise
        reason = str(e).splitlines()[0].removeprefix("INVALID_ARGUMENT: ")
        raise TopologyError(
            f"invalid TPU topology {topology!r} ({reason}); expected {expected}"
        ) from e
    except RuntimeError as e:  # "JAX TPU support not installed": jax found no libtpu to load
        if "not installed" not in str(e):
            raise
        raise TopologyError(
            f"cannot describe TPU topology {topology!r}: libtpu is not installed. Ahead-of-time "
            f"TPU compiles need it, not a TPU: pip install -r requirements.txt (pins libtpu)"
        ) from e
    return list(desc.devices)


def hbm_bytes(topology: str) -> int:
    """HBM bytes per chip of the topology's TPU generation (its name's prefix)."""
    gen = topology.split(":")[0].split("-")[0]
    if gen not in HBM_GIB:
        raise TopologyError(
            f"unknown TPU generation {gen!r} in {topology!r}; known: {sorted(HBM_GIB)}"
        )
    return int(HBM_GIB[gen] * GiB)


# --- the train step ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """The real train step compiled for a topology, with what it was built from."""

    topology: str
    built: Built
    compiled: Any  # jax.stages.Compiled, or program.TwoPrograms of two (train.separate_update)
    lower_s: float
    compile_s: float


def for_tpu(cfg: Config) -> Config:
    """cfg with kernels.gmm_backend="auto" resolved for TPU ("auto" picks by the platform this
    process runs on, which for an AOT compile is the host's CPU)."""
    if cfg.kernels.gmm_backend != "auto":
        return cfg
    from moetext.kernels.gmm import auto_backend_name

    return cfg.replace(
        kernels=dataclasses.replace(cfg.kernels, gmm_backend=auto_backend_name("tpu"))
    )


def compile_step(
    cfg: Config, topology: str, compiler_options: dict[str, str] | None = None
) -> CompiledStep:
    """Builds the train state abstractly on the topology's chips and compiles the train step.
    compiler_options go to XLA (e.g. {"xla_dump_to": DIR}, read by `buffer_assignment_temp`).

    Raises TopologyError before any work for a topology that cannot be described, and XLA's
    JaxRuntimeError when it refuses to compile (`exceeds_hbm` tells a step too big for HBM).
    """
    from moetext import program
    from moetext.data.batch import batch_keys

    hbm_bytes(topology)  # an unknown generation fails now, not after minutes of compiling
    cfg = for_tpu(cfg)
    b = program.build(cfg, tpu_devices(topology), abstract=True)
    # The batch the trainer feeds: chat data carries a loss_mask the step must take.
    keys = batch_keys(cfg.data.kind)
    batch = program.abstract_batch(
        cfg.data.global_batch_size, cfg.data.seq_len, b.batch_sharding, keys
    )
    t0 = time.perf_counter()
    with pallas_target.compiling_for(chip_of_topology(topology)):  # Mosaic, not interpret
        lowered = program.lower_checked(b, program.jit_train_step(b), b.state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options)
    return CompiledStep(topology, b, compiled, t1 - t0, time.perf_counter() - t1)


def chip_of_topology(topology: str) -> str:
    """The Pallas tiling chip ('v5e', 'v5p', 'v6e', 'tpu7x') of a topology's devices."""
    from moetext.kernels.pallas.tiling import chip_from_device_kind

    kind = tpu_devices(topology)[0].device_kind
    chip = chip_from_device_kind(kind)
    if chip is None:
        raise TopologyError(f"no Pallas tiling for TPU device kind {kind!r} of {topology!r}")
    return chip


def buffer_assignment_temp(dump_dir: str | Path, module: str = "jit_train_step") -> int:
    """Bytes of a program's temporaries as XLA's buffer assignment lays them out: the HBM
    "preallocated-temp" allocation in the `xla_dump_to` dump's buffer-assignment file of the
    HLO module named `module` (the report's "module": the step's, or its larger program's).

    On TPU, `memory_analysis()` reports more temporaries than this (docs/performance.md, "AOT
    memory per chip"): the difference is added by the backend after buffer assignment, so it
    never shows in the dump's buffer lists or its memory-usage report."""
    files = sorted(Path(dump_dir).glob(f"*.{module}.*after_optimizations-buffer-assignment.txt"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"expected one buffer assignment of {module} in the XLA dump {str(dump_dir)!r}, "
            f"found {len(files)}: {[f.name for f in files]}"
        )
    # Only the default memory space (HBM): other colors (VMEM, SMEM) name themselves.
    heap = re.compile(r"allocation \d+: size (\d+), page \d+, preallocated-temp")
    return sum(int(m.group(1)) for m in heap.finditer(files[0].read_text()))


def exceeds_hbm(error: Exception) -> bool:
    """Whether XLA refused to finish compiling because the program's buffers exceed HBM: the
    answer "does not fit", with XLA's own numbers in the message."""
    return "RESOURCE_EXHAUSTED" in str(error) or "HbmOom" in str(error)


def programs(compiled: Any) -> list[tuple[str, jax.stages.Compiled]]:
    """(name, program) of a compiled step: one, or the gradient and the update of
    train.separate_update (`program.TwoPrograms`)."""
    from moetext.program import TwoPrograms

    if isinstance(compiled, TwoPrograms):
        return [("gradient", compiled.gradient), ("update", compiled.update)]
    return [("step", compiled)]


def hlo_text(compiled: Any) -> str:
    """The optimised HLO of every program of a compiled step, one after another."""
    return "\n".join(c.as_text() or "" for _, c in programs(compiled))


def _program_memory(name: str, compiled: jax.stages.Compiled, topology: str) -> dict[str, Any]:
    mem = compiled.memory_analysis()
    if mem is None:  # the TPU compiler always provides one
        raise RuntimeError(f"XLA gave no memory analysis for the program on {topology}")
    args, temps = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    outs, alias = mem.output_size_in_bytes, mem.alias_size_in_bytes
    module = re.match(r"HloModule ([^\s,]+)", compiled.as_text() or "")
    return {
        "program": name,
        "module": module.group(1) if module else name,
        "arguments_bytes": args,
        "temporaries_bytes": temps,
        "outputs_bytes": outs,
        "alias_bytes": alias,
        # Donated inputs: outputs that alias arguments take no extra memory.
        "total_bytes": args + temps + outs - alias,
    }


def memory_and_cost(compiled: Any, topology: str) -> dict[str, Any]:
    """Per-chip buffer bytes against the chip's HBM, and XLA's FLOPs and bytes accessed. A step
    of two programs reports the one with the larger total (each program's arguments include
    the whole train state, so its total is what the chip holds while it runs) and lists both
    under "programs"; FLOPs and bytes accessed are summed."""
    progs = programs(compiled)
    each = [_program_memory(name, c, topology) for name, c in progs]
    peak = max(each, key=lambda m: m["total_bytes"])
    hbm = hbm_bytes(topology)
    nan = float("nan")
    flops = accessed = 0.0
    for _, c in progs:
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        flops += float(cost.get("flops", nan)) if cost else nan
        accessed += float(cost.get("bytes accessed", nan)) if cost else nan
    out = {
        **{k: v for k, v in peak.items() if k.endswith("_bytes")},
        "module": peak["module"],
        "hbm_bytes": hbm,
        "fits": peak["total_bytes"] <= hbm,
        # XLA's cost analysis counts a while body once (a layer scan's FLOPs appear once).
        "xla_flops_per_chip": flops,
        "xla_bytes_accessed_per_chip": accessed,
    }
    if len(each) > 1:
        out["programs"] = each
    return out


def report(step: CompiledStep) -> dict[str, Any]:
    """Per-chip memory against HBM, FLOPs and collectives of a compiled step (JSON-ready)."""
    from moetext.models.flops import flops_per_token

    cfg, b, compiled = step.built.cfg, step.built, step.compiled
    chips = b.mesh.devices.size
    tokens_per_chip = cfg.data.global_batch_size * cfg.data.seq_len / chips
    text = hlo_text(compiled)
    coll = hlo.collectives(text)
    by_shape = sorted(hlo.collectives(text, by="shape").items(), key=lambda kv: -kv[1]["bytes"])
    by_axis = hlo.collectives(text, by="axis", mesh_shape=dict(b.mesh.shape))
    return {
        "topology": step.topology,
        "chips": chips,
        "mesh": dict(b.mesh.shape),
        "preset": b.plan.preset.name,
        "global_batch_size": cfg.data.global_batch_size,
        "seq_len": cfg.data.seq_len,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "tokens_per_chip": tokens_per_chip,
        "batch": batch_inputs(compiled),
        **memory_and_cost(compiled, step.topology),
        # Model FLOPs (6N + attention, no remat recompute): what MFU is measured against.
        "model_flops_per_chip": flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
        * tokens_per_chip,
        "lower_s": step.lower_s,
        "compile_s": step.compile_s,
        "collectives": [{"op": op, "dtypes": dt, **v} for (op, dt), v in sorted(coll.items())],
        "collectives_by_shape": [{"op": op, "shapes": sh, **v} for (op, sh), v in by_shape],
        "collectives_by_axis": [
            {"op": op, "axes": ax, **v} for (op, ax), v in sorted(by_axis.items())
        ],
    }


def batch_inputs(compiled: Any) -> dict[str, list[int]]:
    """The batch the compiled step takes, {key: global shape}, read from the compiled program's
    arguments (the gradient program's under train.separate_update): (state, batch)."""
    from moetext.program import TwoPrograms

    first = compiled.gradient if isinstance(compiled, TwoPrograms) else compiled
    (_, batch), _ = first.args_info
    return {k: list(v.shape) for k, v in batch.items()}


def format_report(r: dict[str, Any]) -> str:
    """The report as the lines scripts/aot_compile.py prints."""

    def g(n: float) -> str:
        return f"{n / GiB:8.2f} GiB"

    lines = [
        f"topology {r['topology']}: {r['chips']} chips, mesh {r['mesh']}, preset {r['preset']}",
        f"batch {r['global_batch_size']} x {r['seq_len']} = {r['tokens_per_chip']:.0f} "
        f"tokens per chip{_micro_batches(r)}; lower {r['lower_s']:.1f} s, "
        f"compile {r['compile_s']:.1f} s",
        "memory per chip:",
    ]
    for key in ("arguments", "temporaries", "outputs", "alias"):
        lines.append(f"  {key:<12}{g(r[key + '_bytes'])}")
    for p in r.get("programs", []):  # train.separate_update
        lines.append(
            f"    program {p['program']:<9}{g(p['total_bytes'])} total "
            f"({g(p['temporaries_bytes']).strip()} temporaries)"
            + ("  <- the larger, counted here" if p["module"] == r["module"] else "")
        )
    if "buffer_assignment_temp_bytes" in r:  # scripts/aot_compile.py dump=DIR
        heap = r["buffer_assignment_temp_bytes"]
        lines.append(
            f"    of the temporaries: {g(heap).strip()} in XLA's buffer assignment, "
            f"{g(r['temporaries_bytes'] - heap).strip()} added after it"
        )
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    lines += [
        f"  {'total':<12}{g(r['total_bytes'])} of {g(r['hbm_bytes']).strip()} HBM: {verdict}",
        f"FLOPs per chip per step: model {r['model_flops_per_chip']:.4g} (6N + attention); "
        f"XLA cost analysis {r['xla_flops_per_chip']:.4g} (scan body counted once)",
        "collectives per step (ops in the layer scan counted once per layer; results, and the "
        "bytes each chip sends by a ring estimate):",
    ]
    for c in r["collectives"]:
        lines.append(
            f"  {c['op']:<20}{c['dtypes']:<12}{c['count']:>6} x  {g(c['bytes'])} total, "
            f"{g(c['sent']).strip()} sent"
        )
    lines.append("collectives by the mesh axes their device groups span:")
    for c in r.get("collectives_by_axis", []):
        lines.append(
            f"  {c['op']:<20}{c['axes']:<20}{c['count']:>6} x  {g(c['bytes'])} total, "
            f"{g(c['sent']).strip()} sent"
        )
    lines.append("largest collectives by result shape:")
    for c in r["collectives_by_shape"][:8]:
        lines.append(
            f"  {c['op']:<20}{c['shapes']:<32}{c['count']:>6} x  {g(c['bytes'])} total, "
            f"{g(c['sent']).strip()} sent"
        )
    return "\n".join(lines)


def _micro_batches(r: dict[str, Any]) -> str:
    n = r.get("grad_accum_steps", 1)
    return f" in {n} micro-batches (train.grad_accum_steps)" if n > 1 else ""


def compile_decode_step(
    cfg: Config, topology: str, *, batch: int, cache_len: int
) -> dict[str, Any]:
    """The report of `compiled_decode_step` (JSON-ready)."""
    return compiled_decode_step(cfg, topology, batch=batch, cache_len=cache_len)[0]


def compiled_decode_step(
    cfg: Config, topology: str, *, batch: int, cache_len: int
) -> tuple[dict[str, Any], Any]:
    """Compiles one decode step (one new token per row against a KV cache of cache_len slots)
    of the prefused model (its MoE layers on kernels.decode_moe) on the topology's chips, under
    cfg's sharding preset; returns (per-chip memory against HBM, XLA's FLOPs and bytes
    accessed, the collectives and the compile time (JSON-ready); the compiled program), which
    `step_cost.decode_step_cost` turns into a roofline.

    Params take the run's param_dtype; the cache the compute dtype. XLA's refusal to fit is
    raised as from compile_step (`exceeds_hbm`)."""
    from flax import nnx

    from moetext import models
    from moetext.errors import ConfigError
    from moetext.models.moe.decode import prefuse_all
    from moetext.program import make_plan

    hbm_bytes(topology)
    cfg = for_tpu(cfg)
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, scan_layers=False))
    devices = tpu_devices(topology)
    n = len(devices)
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, global_batch_size=n))
    plan = make_plan(cfg, devices)

    def prefused() -> nnx.Module:
        model = models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
        prefuse_all(model, cfg.kernels.decode_moe)
        return model

    abstract = nnx.eval_shape(prefused)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    shardings = plan.shardings_for(params)

    def sds(shape: tuple[int, ...], dt: Any, sharding: Any) -> Any:
        # jax: ShapeDtypeStruct.__init__ is unannotated.
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # type: ignore[no-untyped-call]

    family = models.get_family(cfg.model.family)
    if family.decode_cache is None:
        raise ConfigError(f"model.family={family.name!r} does not decode (no decode cache)")
    caches = jax.tree.map(
        lambda a: sds(a.shape, jax.numpy.dtype(a.dtype), plan.sharding(a.names)),
        family.decode_cache(cfg.model, batch, cache_len),
        is_leaf=models.is_cache_array,
    )
    rows = plan.sharding(("batch", None))
    tokens = sds((batch, 1), jax.numpy.int32, rows)
    first_valid = sds((batch,), jax.numpy.int32, plan.sharding(("batch",)))
    slot = sds((), jax.numpy.int32, plan.replicated)
    abstract_params = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), params, shardings)

    def step(
        p: Any, tok: jax.Array, pos: jax.Array, cs: Any, at: jax.Array, first: jax.Array
    ) -> tuple[jax.Array, Any]:
        model: Any = nnx.merge(graphdef, p, rest)
        out: tuple[jax.Array, Any] = model.cached(tok, pos, cs, at, first)
        return out

    jitted = jax.jit(step, donate_argnums=(3,))
    t0 = time.perf_counter()
    with plan.rules(), pallas_target.compiling_for(chip_of_topology(topology)):
        lowered = jitted.lower(abstract_params, tokens, tokens, caches, slot, first_valid)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t1
    out = {
        "topology": topology,
        "chips": n,
        "mesh": dict(plan.mesh.shape),
        "preset": plan.preset.name,
        "batch": batch,
        "cache_len": cache_len,
        "decode_moe": cfg.kernels.decode_moe,
        "num_layers": cfg.model.num_layers,
        **memory_and_cost(compiled, topology),
        "lower_s": t1 - t0,
        "compile_s": compile_s,
        "collectives": [
            {"op": op, "dtypes": dt, **v}
            for (op, dt), v in sorted(hlo.collectives(hlo_text(compiled)).items())
        ],
    }
    return out, compiled
