"""Runs one hf-to-orbax conversion through the CLI's entry point (as a user runs it) for
test_streaming_memory.py, after a handshake so the parent can read this process's anonymous
memory before and during the conversion.

    python -m tests.convert.memory_worker HF_DIR OUT_DIR
"""

from __future__ import annotations

import sys

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext.convert import hf_to_orbax  # noqa: F401  (the CLI imports it lazily)
from moetext.convert.__main__ import main

# Everything the conversion imports is loaded before the baseline is read.
import jax.numpy as jnp  # isort: skip

jnp.zeros(1).block_until_ready()
print("READY", flush=True)
sys.stdin.readline()
assert main(["hf-to-orbax", "--hf", sys.argv[1], "--out", sys.argv[2]]) == 0
print("DONE", flush=True)
