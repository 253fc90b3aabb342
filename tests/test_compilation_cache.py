"""moetext.compilation_cache: where `python -m train` and `python -m moetext.generate` keep
compiled programs (train.compilation_cache_dir), per host CPU, and that a run loading its
programs from the cache computes what a fresh compile computes."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fake_devices import xla_flags
from moetext import compilation_cache as cc
from moetext import config
from moetext.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
QUIET = [
    "data.kind=synthetic",
    "data.seq_len=32",
    "train.steps=3",
    "train.log_every=1",
    "train.progress_bar=false",
    "train.tensorboard=false",
    "train.peak_tflops=1",
    "checkpoint.enabled=false",
]

CPU = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
cpu MHz\t\t: 2595.124
flags\t\t: fpu sse2 avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
cpu MHz\t\t: 2595.124
flags\t\t: fpu sse2 avx2 fma
"""


def test_the_auto_folder_follows_the_environment_like_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(cc.ENV, str(tmp_path / "m"))
    assert cc.default_dir() == str(tmp_path / "m")
    assert cc.resolve("auto") == str(tmp_path / "m" / cc.host_key())
    monkeypatch.delenv(cc.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.default_dir() == str(tmp_path / "xdg" / "moetext" / "jax_cache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.default_dir() == str(tmp_path / "home" / ".cache" / "moetext" / "jax_cache")
    assert cc.resolve(str(tmp_path / "c")) == str(tmp_path / "c" / cc.host_key())
    assert cc.resolve(None) is None


ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
"""


def test_the_host_key_changes_with_the_cpu_features_and_nothing_else():
    key = cc.host_key(CPU)
    assert re.fullmatch(rf"{re.escape(platform.machine())}-[0-9a-f]{{16}}", key), key
    # The clock and the other processors' blocks are not what XLA compiles for.
    assert cc.host_key(CPU.replace("2595.124", "3000.000")) == key
    assert cc.host_key(CPU.split("\n\n")[0]) == key
    assert cc.host_key(CPU.replace("avx2 fma", "avx2 fma avx512f", 1)) != key
    assert cc.host_key(CPU.replace("AMD EPYC", "Intel Xeon", 1)) != key
    assert cc.host_key() == cc.host_key()  # this host's, stable
    # Arm: the implementer and part name the core; the BogoMIPS line is not a feature.
    arm = cc.host_key(ARM)
    assert cc.host_key(ARM.replace("243.75", "250.00")) == arm
    assert cc.host_key(ARM.replace("0xd0c", "0xd40")) != arm
    # None of the known fields (another architecture): the block without its changing lines.
    other = "processor\t: 0\ncpu\t\t: POWER9\nclock\t\t: 2300MHz\ncpu MHz\t: 2300\n"
    assert cc.host_key(other) == cc.host_key(other.replace("cpu MHz\t: 2300", "cpu MHz\t: 3800"))
    assert cc.host_key(other) != cc.host_key(other.replace("POWER9", "POWER10"))


def test_a_dump_or_null_runs_without_it(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert cc.why_off("auto") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_dump_hlo_as_text")
    assert (cc.why_off("auto") or "").startswith("XLA_FLAGS has --xla_dump_to")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_dump_to=/tmp/d")
    assert (cc.why_off("auto") or "").startswith("LIBTPU_INIT_ARGS has --xla_dump_to")
    assert "null" in (cc.why_off(None) or "")


# `enable` sets JAX's process-wide options: each case runs in its own interpreter.
ENABLE = """
import json, sys
import jax
from moetext import compilation_cache as cc
folder, line = cc.enable(None if sys.argv[1] == "null" else sys.argv[1])
print(json.dumps({"folder": folder, "line": line,
                  "on": jax.config.jax_enable_compilation_cache,
                  "dir": jax.config.jax_compilation_cache_dir,
                  "cap": jax.config.jax_compilation_cache_max_size}))
"""


def _enable(setting: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ENABLE, setting],
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict = json.loads(out.stdout.splitlines()[-1])
    return result


def test_enable_creates_a_private_capped_folder_or_says_why_it_is_off(tmp_path):
    key = cc.host_key()
    got = _enable(str(tmp_path / "c"))
    assert got["folder"] == got["dir"] == str(tmp_path / "c" / key) and got["on"]
    assert got["line"] == f"compilation cache {tmp_path / 'c' / key}"
    assert got["cap"] == cc.MAX_BYTES
    assert (tmp_path / "c" / key).stat().st_mode & 0o777 == 0o700
    # JAX's own variable decides the cap when set (-1: none).
    assert _enable(str(tmp_path / "c"), JAX_COMPILATION_CACHE_MAX_SIZE="-1")["cap"] == -1
    # A bucket: no folder made here, JAX's default (no cap, no lock file to go stale).
    got = _enable("gs://bucket/cache")
    assert got["dir"] == f"gs://bucket/cache/{key}" and got["on"] and got["cap"] == -1
    # Off, and why: a folder that cannot be made, null.
    (tmp_path / "file").write_text("")
    got = _enable(str(tmp_path / "file" / "c"))
    assert got["folder"] is None and not got["on"]
    assert got["line"].startswith(f"compilation cache off: cannot create '{tmp_path}/file/c/")
    got = _enable("null")
    assert (
        not got["on"]
        and got["line"] == "compilation cache off: train.compilation_cache_dir is null"
    )


def test_the_config_key_is_a_path_auto_or_null(tmp_path, monkeypatch):
    assert config.load(TINY).train.compilation_cache_dir == "auto"
    assert (
        config.load(TINY, ["train.compilation_cache_dir=null"]).train.compilation_cache_dir is None
    )
    monkeypatch.chdir(tmp_path)
    got = config.load(TINY, ["train.compilation_cache_dir=cache/"]).train.compilation_cache_dir
    assert got == str(tmp_path / "cache")  # absolute, as every path key
    under_file = tmp_path / "f"
    under_file.write_text("")
    bad = config.load(TINY, [f"train.compilation_cache_dir={under_file}/x"])
    with pytest.raises(ConfigError, match=rf"train.compilation_cache_dir '{under_file}/x'"):
        config.validate_paths(bad)


# Every program is written, however fast this host compiles it (JAX's default: only those
# that took 1 s or more).
EVERY_PROGRAM = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _train(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "train", str(TINY), *QUIET, f"train.run_dir={run_dir}", *overrides],
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **EVERY_PROGRAM, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _computed(rows: list[dict]) -> list[dict]:
    """The step rows without their timings."""
    timed = ("step_time_s", "tokens_per_s", "mfu")
    return [{k: v for k, v in r.items() if k not in timed} for r in rows if "loss" in r]


@pytest.mark.slow
def test_a_second_run_loads_its_programs_and_computes_the_same_bits(tmp_path):
    cache = tmp_path / "cache"
    folder = cache / cc.host_key()
    first = _train(tmp_path / "a", f"train.compilation_cache_dir={cache}")
    assert f"compilation cache {folder}\n" in first
    step = sorted(p.name.split("-")[0] for p in folder.glob("jit_train_step_*-cache"))
    assert step == ["jit_train_step_gradient", "jit_train_step_update"], step  # separate_update
    (compiled,) = [r for r in _rows(tmp_path / "a") if r.get("event") == "compiled"]
    assert compiled["compile_cache_hits"] == 0
    written = set(folder.iterdir())

    _train(tmp_path / "b", f"train.compilation_cache_dir={cache}")
    (compiled,) = [r for r in _rows(tmp_path / "b") if r.get("event") == "compiled"]
    assert compiled["compile_cache_hits"] == 2  # the step's two programs, loaded
    assert not {p for p in folder.glob("*-cache")} - written  # nothing compiled anew
    assert _computed(_rows(tmp_path / "b")) == _computed(_rows(tmp_path / "a"))

    # A run that dumps its HLO compiles (a cached program writes no dump) and says why.
    dump = tmp_path / "dump"
    off = _train(
        tmp_path / "c",
        f"train.compilation_cache_dir={cache}",
        env={"XLA_FLAGS": f"{xla_flags()} --xla_dump_to={dump}"},
    )
    assert "compilation cache off: XLA_FLAGS has --xla_dump_to" in off
    assert list(dump.glob("*train_step_gradient*"))
    (compiled,) = [r for r in _rows(tmp_path / "c") if r.get("event") == "compiled"]
    assert "compile_cache_hits" not in compiled
    assert _computed(_rows(tmp_path / "c")) == _computed(_rows(tmp_path / "a"))
