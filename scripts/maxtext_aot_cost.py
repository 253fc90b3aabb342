"""MaxText's train step, compiled by the same libtpu for the same TPU topology, through moetext's
step-cost instrument (moetext.step_cost), so the two rows compare like with like.

    .venv/bin/python scripts/maxtext_aot_cost.py --model qwen3-30b-a3b --topology v5p:4x4x2 \\
        --per_device_batch 1 --seq_len 4096 [--remat full] [--json FILE]

MaxText 0.2.5 itself compiles (../shared/tools/maxtext_aot_compile.sh: its own venv, created on
first use, ~5 min, plus libtpu), with XLA dumping the optimised HLO of its train step; this
script reads that HLO and MaxText's memory analysis and prints the same report as
`scripts/aot_compile.py ... cost=true`, with the same JSON fields. `model_flops` comes from
moetext's models/flops.py for the matching moetext config (configs/models/<model>.yml), for both
rows. The figures are compiler-derived estimates, not timings.

--topology is moetext's libtpu name (v5p:4x4x2 = 32 chips); MaxText's compile_topology counts
TensorCores on v5p and tpu7x (v5p-64) and chips on v5e/v6e; --maxtext_topology overrides the
translation. --remat takes a moetext remat_policy (none, full, save_dots) and passes MaxText its
equivalent (REMAT below), or a MaxText policy name as maxtext:NAME.

Multi-token prediction: MaxText's `mtp_num_layers` defaults to 0 (base.yml) and its DeepSeek-V3
config does not set it, while the moetext config trains the released checkpoint's MTP depth
(`model.mtp_layers: 1`), which `model_flops` counts. The script passes MaxText
`mtp_num_layers=<model.mtp_layers>` so both programs train the same model; an explicit
`mtp_num_layers=N` among the extra keys wins (then `model_flops` still counts moetext's depth).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import moetext  # noqa: E402,F401,I001
from moetext import aot, config, hlo, models, step_cost  # noqa: E402,F401

TOOL = REPO.parent / "shared" / "tools" / "maxtext_aot_compile.sh"
# MaxText model_name -> the moetext config of the same published shape.
MODELS = {
    "qwen3-30b-a3b": "configs/models/qwen3-30b-a3b.yml",
    "qwen3-235b-a22b": "configs/models/qwen3-235b-a22b.yml",
    "deepseek3-671b": "configs/models/deepseek-v3-671b.yml",
}
# moetext remat_policy -> MaxText 0.2.5's remat_policy (maxtext/layers/nnx_decoders.py
# get_remat_policy): none saves everything (MaxText 'none': no jax.checkpoint), full recomputes
# the layer (MaxText 'full'), save_dots keeps the matmuls without batch dims
# (checkpoint_dots_with_no_batch_dims: the projections; MaxText 'minimal' keeps its named
# projections q/k/v/out and the MLP's wi/wo; neither keeps attention's batched dots).
REMAT = {"none": "none", "full": "full", "save_dots": "minimal"}
# TensorCores per chip in MaxText's compile_topology names.
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "tpu7x": 2, "v5e": 1, "v5litepod": 1, "v6e": 1}


def maxtext_topology(topology: str) -> str:
    gen, _, shape = topology.partition(":")
    if gen not in CORES_PER_CHIP or not re.fullmatch(r"\d+(x\d+)*", shape):
        raise SystemExit(
            f"maxtext_aot_cost: cannot translate topology {topology!r} (expected GEN:AxB[xC] with "
            f"GEN in {sorted(CORES_PER_CHIP)}); pass --maxtext_topology"
        )
    chips = math.prod(int(d) for d in shape.split("x"))
    return f"{gen}-{chips * CORES_PER_CHIP[gen]}"


def _memory(log: str) -> dict[str, int]:
    m = re.search(r"Memory analysis: CompiledMemoryStats\((.*?)\)", log)
    if not m:
        return {}
    fields = dict(re.findall(r"(\w+)_in_bytes=(\d+)", m.group(1)))
    return {f"{k}_bytes": int(v) for k, v in fields.items()}


def _train_step_hlo(dump: Path) -> str:
    files = sorted(dump.glob("*train_step*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not files:
        raise SystemExit(f"maxtext_aot_cost: no optimised train_step HLO was dumped under {dump}")
    return files[-1].read_text()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/maxtext_aot_cost.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--topology", required=True, help="libtpu topology, e.g. v5p:4x4x2")
    p.add_argument("--per_device_batch", type=int, required=True)
    p.add_argument("--seq_len", type=int, required=True)
    p.add_argument("--remat", default="full", help="none, full, save_dots or maxtext:NAME")
    p.add_argument("--maxtext_topology", help="MaxText's compile_topology, e.g. v5p-64")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--out", help="keep MaxText's log and HLO dump here (default: a temp dir)")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read the log and HLO dump an earlier run left in --out instead of compiling",
    )
    p.add_argument("extra", nargs="*", metavar="maxtext_key=value")
    a = p.parse_args(argv)
    if a.remat.startswith("maxtext:"):
        remat = a.remat.removeprefix("maxtext:")
    elif a.remat in REMAT:
        remat = REMAT[a.remat]
    else:
        p.error(f"--remat {a.remat!r}: expected one of {sorted(REMAT)} or maxtext:NAME")
    topo = a.maxtext_topology or maxtext_topology(a.topology)
    out = Path(a.out or tempfile.mkdtemp(prefix="maxtext_aot_"))
    out.mkdir(parents=True, exist_ok=True)
    dump = out / "xla"
    env = {
        **os.environ,
        "OUT": str(out),
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
        "--xla_dump_hlo_module_re=.*train_step.*",
    }
    cfg = config.load(REPO / MODELS[a.model], [f"data.seq_len={a.seq_len}"])
    mtp = int(getattr(cfg.model, "mtp_layers", 0))
    extra = list(a.extra)
    if mtp and not any(e.startswith("mtp_num_layers=") for e in extra):
        extra.append(f"mtp_num_layers={mtp}")
    cmd = [
        "bash",
        str(TOOL),
        a.model,
        topo,
        f"per_device_batch_size={a.per_device_batch}",
        f"max_target_length={a.seq_len}",
        f"remat_policy={remat}",
        *extra,
    ]
    if a.reuse and not a.out:
        p.error("--reuse reads --out DIR: give the directory of the earlier run")
    if not a.reuse:
        run = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if run.returncode != 0:
            err = run.stderr[-3000:]
            print(f"maxtext_aot_cost: MaxText's compile failed:\n{err}", file=sys.stderr)
            return 1
    log = (out / "maxtext_aot.log").read_text()
    text = _train_step_hlo(dump)

    model_flops = models.get_family(cfg.model.family).flops_per_token(
        cfg.model, cfg.moe, a.seq_len
    ) * (a.per_device_batch * a.seq_len)
    coll = hlo.collectives(text)
    r: dict = {
        "framework": "maxtext 0.2.5",
        "model": a.model,
        "topology": a.topology,
        "maxtext_topology": topo,
        "per_device_batch": a.per_device_batch,
        "seq_len": a.seq_len,
        "remat": a.remat,
        "maxtext_remat_policy": remat,
        "maxtext_extra": extra,
        "model_flops_per_chip": model_flops,
        **_memory(log),
        "collectives": [{"op": op, "dtypes": dt, **v} for (op, dt), v in sorted(coll.items())],
    }
    r.update(step_cost.step_cost(r, [text]))
    mem = r.get("argument_size_bytes"), r.get("temp_size_bytes")
    print(
        f"MaxText {a.model} on {a.topology} ({topo}), {a.per_device_batch} x {a.seq_len} tokens "
        f"per device, remat {remat}: arguments {mem[0] / 1e9 if mem[0] else float('nan'):.2f} GB, "
        f"temporaries {mem[1] / 1e9 if mem[1] else float('nan'):.2f} GB per device"
    )
    print(step_cost.format_cost(r))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
