"""JAX's persistent compilation cache for the CLIs: a re-run, a resume after preemption or a
second `generate` on the same model loads its compiled programs from disk instead of compiling
them again.

`train.compilation_cache_dir` chooses where (`"auto"`, the default: `default_dir()`; a path;
null: off). `python -m train` and `python -m moetext.generate` call `enable` once, as their
process starts and before anything is compiled; in-process callers of their `main` (tests)
leave JAX's cache as it is.

What is cached, and what is not:

- A program is written only when it took at least `jax_persistent_cache_min_compile_time_secs`
  (JAX's default, 1 s) to compile; only process 0 of a distributed run writes (JAX's rule).
- JAX keys an entry on the program, jaxlib, the backend, XLA flags and compile options, not on
  the host CPU, and an XLA:CPU entry is native code for the CPU that compiled it. So entries go
  under a subfolder named for this host's CPU (`host_key`): machines sharing a home directory
  or a bucket reuse each other's entries only when their CPUs match.
- A run with `--xla_dump_to` in XLA_FLAGS or LIBTPU_INIT_ARGS gets no cache: JAX leaves the
  dump flags out of its key, so a program loaded from the cache would write no dump.
- Each host's local subfolder is capped at `MAX_BYTES` (least recently used entries go first)
  unless JAX_COMPILATION_CACHE_MAX_SIZE is set (-1: no cap); with a cap JAX also locks the
  folder while it reads or writes an entry, so runs on one machine can share it (a read that
  waits over 10 s for the lock compiles instead, with a warning). A bucket (gs://...) keeps
  JAX's default: no cap and no lock.

A cached program is the same executable the compiler produced: results are bit for bit those of
a fresh compile (tests/test_compilation_cache.py). An entry cut short (a process killed while
writing it) fails to load: JAX warns, compiles, and keeps the broken file; delete the folder.
Anyone who can write to the folder can run code in your runs (JAX's warning): keep it private.
"""

from __future__ import annotations

import hashlib
import os
import platform
from typing import Any

from moetext import paths

ENV = "MOETEXT_COMPILATION_CACHE_DIR"
AUTO = "auto"
MAX_BYTES = 8 * 2**30
HITS_EVENT = "/jax/compilation_cache/cache_hits"

_hits = 0
_listening = False


def default_dir() -> str:
    """$MOETEXT_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/moetext/jax_cache, else
    ~/.cache/moetext/jax_cache (the corpus's default data dir sits beside it), absolute."""
    return paths.resolve(paths.user_cache_dir(ENV, "jax_cache"))


# /proc/cpuinfo fields that name the CPU and its features (x86: vendor, model, flags; Arm:
# implementer, part, features).
CPU_FIELDS = (
    "vendor_id",
    "model name",
    "flags",
    "Features",
    "CPU implementer",
    "CPU architecture",
    "CPU variant",
    "CPU part",
)
# Fields that change between boots or processors of one CPU model, left out when none of
# CPU_FIELDS is there and the whole block is hashed.
CHANGING = ("processor", "cpu MHz", "BogoMIPS", "bogomips", "core id", "apicid", "initial apicid")


def host_key(cpuinfo: str | None = None) -> str:
    """What XLA:CPU compiles for, as a folder name: the architecture and a hash of the CPU's
    model and features, from the first processor of `cpuinfo` (default: Linux's /proc/cpuinfo,
    else macOS's sysctl CPU brand and features, else the platform's processor string)."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    if cpuinfo is None:
        described = _sysctl_cpu() or platform.processor()
    else:
        first = [ln for ln in cpuinfo.split("\n\n", 1)[0].splitlines() if ln.strip()]
        wanted = [ln for ln in first if ln.partition(":")[0].strip() in CPU_FIELDS]
        described = "\n".join(
            wanted or [ln for ln in first if ln.partition(":")[0].strip() not in CHANGING]
        )
    digest = hashlib.sha256(described.encode()).hexdigest()[:16]
    return f"{platform.machine() or 'unknown'}-{digest}"


def _read_cpuinfo() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


def _sysctl_cpu() -> str | None:
    """macOS: the CPU's brand string and feature lists (Apple silicon reports its model in
    the brand)."""
    import subprocess

    keys = ["machdep.cpu.brand_string", "machdep.cpu.features", "machdep.cpu.leaf7_features"]
    try:
        out = subprocess.run(["sysctl", *keys], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def resolve(setting: str | None) -> str | None:
    """The folder programs are cached in for `train.compilation_cache_dir` (its host
    subfolder), or None when the cache is off."""
    if setting is None:
        return None
    base = default_dir() if setting == AUTO else setting
    return str(paths.as_epath(base) / host_key())


def why_off(setting: str | None) -> str | None:
    """Why this process runs without the cache, or None when it can use it."""
    if setting is None:
        return "train.compilation_cache_dir is null"
    for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        if "--xla_dump_to" in os.environ.get(var, ""):
            return f"{var} has --xla_dump_to (a cached program writes no dump)"
    return None


def enable(setting: str | None) -> tuple[str | None, str]:
    """Points JAX's persistent cache at `resolve(setting)` before the process compiles
    anything; returns the folder (None: off) and a line for the log. A folder that cannot be
    created leaves the cache off and says why (the run goes on; `python -m train` refused an
    unwritable explicit path earlier, in `moetext.config.validate_paths`)."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    reason = why_off(setting)
    folder = None if reason else resolve(setting)
    if folder is not None and not paths.is_uri(folder):
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)  # yours: its programs run
        except OSError as e:
            folder, reason = None, f"cannot create {folder!r}: {e.strerror}"
    _set("jax_enable_compilation_cache", folder is not None)
    if folder is not None:
        _set("jax_compilation_cache_dir", folder)
        # JAX's default is no cap and no lock. A local folder gets both; a bucket keeps JAX's
        # default (its lock would be a file that a killed process leaves behind, and only
        # process 0 of a pod writes).
        if not paths.is_uri(folder) and "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
            _set("jax_compilation_cache_max_size", MAX_BYTES)
        _listen()
    # JAX decides whether to use its cache at the first compile of the process and keeps
    # that answer: a small program compiled while loading (generate) would have decided it.
    reset_cache()
    if folder is None:
        return None, f"compilation cache off: {reason}"
    return folder, f"compilation cache {folder}"


def _set(name: str, value: Any) -> None:
    import jax

    jax.config.update(name, value)  # type: ignore[no-untyped-call]


def _listen() -> None:
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_listener(_count)
        _listening = True


def _count(event: str, **_: Any) -> None:
    global _hits
    if event == HITS_EVENT:
        _hits += 1


def hits() -> int | None:
    """Programs this process has loaded from the cache so far; None when it is not on."""
    return _hits if _listening else None
