"""Test session defaults: CPU platform, quiet libtpu, float64 available for oracles."""

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Parallel test workers (pytest -n) each load libtpu for AOT compiles; without this the
# second one fails on libtpu's lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The embedded corpus (data.name=python_docs, used by the tiny config) is prepared once per
# checkout here, not in the user's cache; xdist workers and subprocesses share it (file lock).
os.environ.setdefault(
    "MOETEXT_DATA_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache/moetext_data")
)
# The trainer and generate subprocesses (python -m train, python -m moetext.generate) keep their
# compiled programs here (train.compilation_cache_dir "auto"; moetext/compilation_cache.py),
# per checkout like the corpus: a program the suite compiled once (the tiny config's step, again
# in every resumed or repeated run) is loaded after that, not compiled again.
os.environ.setdefault(
    "MOETEXT_COMPILATION_CACHE_DIR",
    str(Path(__file__).resolve().parents[1] / ".pytest_cache/moetext_jax_cache"),
)

# XLA:CPU's LLVM backend at -O0 for what the suite compiles, in its own processes and in every
# subprocess that inherits this environment (fake_devices.xla_flags keeps it where a test sets
# a device count). The suite's programs are small (tiny configs, a few steps each), so it spends
# far more time compiling them than running them, and -O0 compiles them faster (tests/train:
# 473 -> 402 s; docs/testing.md). It changes no HLO: the XLA passes, the sharding and the TPU
# AOT programs are the same (a TPU compile's optimised HLO is byte-identical). Only the CPU
# machine code changes, and with it float32 results in the last bits against a user's default
# build; end_to_end/cpu/run_all.sh unsets XLA_FLAGS and runs the README's path at the default.
# A level already in XLA_FLAGS wins.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [*os.environ.get("XLA_FLAGS", "").split(), "--xla_backend_optimization_level=0"]
    )

import moetext  # noqa: E402,F401  (quiets libtpu before jax initialises)
import moetext.models  # noqa: E402,F401  (the model families register their config sections)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _in_process_compilation_cache() -> None:
    """The same cache for programs compiled in the test processes themselves: many tests build
    the same tiny model and compile its step again (a resumed run, a run beside its reference),
    and a program compiled once in the session is loaded after that (bit-identical: what
    test_compilation_cache asserts for the CLIs). libtpu's compile-only clients (the TPU AOT
    tests) write entries they cannot read back (PjRtCompiler must be constructed with a
    Client), so only CPU programs use it."""
    from jax._src import compilation_cache as jax_cache

    from moetext import compilation_cache

    used = jax_cache.is_cache_used

    def cpu_only(backend: Any) -> bool:
        return backend.platform == "cpu" and used(backend)

    jax_cache.is_cache_used = cpu_only
    compilation_cache.enable(compilation_cache.AUTO)


_in_process_compilation_cache()
