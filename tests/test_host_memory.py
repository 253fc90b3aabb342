"""moetext.host_memory: XLA:CPU's per-call buffers are reused, not mapped and faulted in again.

The oracle is the kernel's own count of minor page faults (getrusage) over calls of a jitted
program whose output is 128 MB (32,768 4-KiB pages) and whose buffers XLA allocates anew on
every call. Under glibc's defaults each call maps fresh pages and faults nearly all of them in;
with moetext's settings the heap grows a few times (the alignment slack, moetext/host_memory.py)
and then calls reuse freed blocks and fault in (almost) none. Each arm runs in a fresh
interpreter that imports numpy and JAX before applying the settings, as scripts/bench_train.py
does, so the test also covers glibc's "arena limit is fixed by the first thread" rule.
"""

import json
import os
import subprocess
import sys

import pytest

from moetext import host_memory

PROGRAM = r"""
import json, resource
import numpy as np
import jax, jax.numpy as jnp
import moetext
from moetext import host_memory

applied = host_memory.reuse_freed_memory()

x = jnp.ones((16 * 1024 * 1024,), jnp.float32)  # 64 MB
f = jax.jit(lambda x: jnp.concatenate([x * 2.0, x + 1.0]))  # a 128 MB output per call
faults = []
for _ in range(32):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = f(x)
    y.block_until_ready()
    del y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""

PAGES = 128 * 1024 * 1024 // 4096


def run(flag: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", host_memory.ENV: flag}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")
def test_reused_buffers_fault_nothing_and_defaults_fault_everything():
    reuse, default = run("1"), run("0")
    assert reuse["applied"] is True and default["applied"] is False
    # Defaults: every call faults in most of its fresh 128 MB (the oracle that the program does
    # allocate anew every call, so the reuse arm's low count is not an accident of the program).
    assert min(default["faults"]) > PAGES // 2, default
    # Reuse: the heap grows on some calls until freed blocks fit (seen: settled after 5-35
    # calls, at most ~1 in 4 of calls 8-31 growing); the median of calls 8-31 faults in under 2%
    # of the pages (a few hundred faults of the interpreter's own small allocations allowed).
    late = sorted(reuse["faults"][8:])
    assert late[len(late) // 2] < PAGES // 50, reuse


def test_bad_flag_is_named(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv(host_memory.ENV, "maybe")
    with pytest.raises(ValueError, match="MOETEXT_REUSE_HOST_MEMORY='maybe'"):
        host_memory.reuse_freed_memory()


def test_trainer_names_a_bad_flag_in_one_line(tmp_path):
    env = {**os.environ, host_memory.ENV: "maybe"}
    out = subprocess.run(
        [sys.executable, "-m", "train", "configs/models/tiny-qwen3-moe.yml"],
        cwd=tmp_path,  # the user's own directory: the entry point fails before reading the config
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "error: MOETEXT_REUSE_HOST_MEMORY='maybe': expected 1 (the default: reuse freed host "
        "memory) or 0"
    )
