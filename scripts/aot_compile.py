"""Ahead-of-time compile of the real train step for a TPU topology; per-chip memory and traffic.

    .venv/bin/python scripts/aot_compile.py configs/models/qwen3-30b-a3b.yml topology=v5p:4x4x2 \\
        sharding.preset=fsdp data.global_batch_size=32 kernels.gmm_backend=ragged_dot

No TPU is needed: libtpu describes the topology's devices, the mesh and shardings come from
the run's sharding preset, and the step is traced under its logical rules exactly as in
training (moetext.aot does the work; this file parses and prints). Prints per-chip memory
(arguments, temporaries, outputs vs the chip's HBM), FLOPs per chip and the collectives of the
compiled HLO; exits 1 when the step does not fit in HBM, 2 for a config or topology error.
Extra options: json=PATH writes the numbers, hlo=PATH writes the optimised HLO text, dump=DIR
has XLA dump the compile there (buffer assignment, memory-usage report) and splits the
temporaries into those of XLA's buffer assignment and those the TPU backend adds after it;
cost=true adds the step-cost report (moetext.step_cost: compiled vs model FLOPs, HBM bytes
accessed, interconnect bytes and a roofline estimate of the step time and MFU; compiler-derived
estimates, not timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# Only describes a topology, never opens a TPU: don't contend for libtpu's one-process lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import moetext  # noqa: E402,F401,I001  (quiets libtpu's TPU probing where there is no TPU)
from jax.errors import JaxRuntimeError  # noqa: E402

from moetext import aot, config, models, step_cost  # noqa: E402,F401  (models: families' config sections)

OPTIONS = ("topology", "json", "hlo", "dump", "cost")


def parse_args(argv: list[str]) -> tuple[str, dict[str, str], list[str]]:
    """(config path, {topology, json, hlo} given, config overrides)."""
    p = argparse.ArgumentParser(
        prog="scripts/aot_compile.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="path to a YAML config, e.g. configs/models/qwen3-30b-a3b.yml")
    p.add_argument(
        "items",
        nargs="*",
        metavar="key=value",
        help="topology=NAME (required), json=PATH, hlo=PATH, dump=DIR, cost=true, "
        "section.key=value",
    )
    args = p.parse_args(argv)
    if "=" in args.config:
        p.error(f"the first argument is the config path, not {args.config!r}")
    options, overrides = {}, []
    for item in args.items:
        key, _, value = item.partition("=")
        if key in OPTIONS:
            options[key] = value
        else:
            overrides.append(item)
    if "topology" not in options:
        p.error("missing topology=NAME, e.g. topology=v5p:4x4x2")
    if options.get("cost", "false") not in ("true", "false"):
        p.error(f"cost={options['cost']!r}: expected cost=true or cost=false")
    return args.config, options, overrides


def main(argv: list[str]) -> int:
    path, options, overrides = parse_args(argv)
    topology = options["topology"]
    try:
        xla = {"xla_dump_to": options["dump"]} if "dump" in options else None
        step = aot.compile_step(config.load(path, overrides), topology, xla)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except aot.TopologyError as e:
        print(f"topology error: {e}", file=sys.stderr)
        return 2
    except JaxRuntimeError as e:
        if not aot.exceeds_hbm(e):
            raise
        print(f"topology {topology}: DOES NOT FIT: {str(e).splitlines()[0]}")
        if "json" in options:
            Path(options["json"]).write_text(json.dumps({"fits": False, "error": str(e)}))
        return 1
    r = aot.report(step)
    if "dump" in options:
        r["buffer_assignment_temp_bytes"] = aot.buffer_assignment_temp(options["dump"], r["module"])
    print(aot.format_report(r))
    if options.get("cost") == "true":
        r.update(
            step_cost.step_cost(r, [c.as_text() or "" for _, c in aot.programs(step.compiled)])
        )
        print(step_cost.format_cost(r))
    if "json" in options:
        Path(options["json"]).write_text(json.dumps(r, indent=1))
    if "hlo" in options:
        Path(options["hlo"]).write_text(aot.hlo_text(step.compiled))
    return 0 if r["fits"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
