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


def test_the_host_key_changes_with_the_cpu_features_and_nothing_else():
    key = cc.host_key(CPU)
    assert re.fullmatch(rf"{re.escape(platform.machine())}-[0-9a-f]{{16}}", key), key
    # The clock and the other processors' blocks are not what XLA compiles for.
    assert cc.host_key(CPU.replace("2595.124", "3000.000")) == key
    assert cc.host_key(CPU.split("\n\n")[0]) == key
    assert cc.host_key(CPU.replace("avx2 fma", "avx2 fma avx512f", 1)) != key
    assert cc.host_key(CPU.replace("AMD EPYC", "Intel Xeon", 1)) != key
    assert cc.host_key() == cc.host_key()  # this host's, stable


def test_a_dump_or_null_runs_without_it(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert cc.why_off("auto") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_dump_hlo_as_text")
    assert "--xla_dump_to" in (cc.why_off("auto") or "")
    assert "null" in (cc.why_off(None) or "")


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


def _train(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "train", str(TINY), *QUIET, f"train.run_dir={run_dir}", *overrides],
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})},
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
    # Programs that took a second or more to compile (JAX's threshold): the gradient program
    # always; the initialisation and the optimizer update when the host is slow enough.
    step_programs = {p.name.split("-")[0] for p in folder.glob("jit_train_step_*-cache")}
    assert "jit_train_step_gradient" in step_programs, list(folder.iterdir())
    (compiled,) = [r for r in _rows(tmp_path / "a") if r.get("event") == "compiled"]
    assert compiled["compile_cache_hits"] == 0

    _train(tmp_path / "b", f"train.compilation_cache_dir={cache}")
    (compiled,) = [r for r in _rows(tmp_path / "b") if r.get("event") == "compiled"]
    assert compiled["compile_cache_hits"] == len(step_programs)  # loaded, not compiled
    assert _computed(_rows(tmp_path / "b")) == _computed(_rows(tmp_path / "a"))

    # A run that dumps its HLO compiles (a cached program writes no dump) and says why.
    dump = tmp_path / "dump"
    off = _train(
        tmp_path / "c",
        f"train.compilation_cache_dir={cache}",
        env={"XLA_FLAGS": f"--xla_dump_to={dump}"},
    )
    assert "compilation cache off: XLA_FLAGS has --xla_dump_to" in off
    assert list(dump.glob("*train_step_gradient*"))
    (compiled,) = [r for r in _rows(tmp_path / "c") if r.get("event") == "compiled"]
    assert "compile_cache_hits" not in compiled
    assert _computed(_rows(tmp_path / "c")) == _computed(_rows(tmp_path / "a"))
