"""Test session defaults: CPU platform, quiet libtpu, float64 available for oracles."""

import os
import sys
from pathlib import Path

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

import moetext  # noqa: E402,F401  (quiets libtpu before jax initialises)
import moetext.models  # noqa: E402,F401  (the model families register their config sections)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
