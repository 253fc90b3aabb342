"""Install assumptions: the wheel trains from outside the repository (configs and sharding presets
ship as package data), and importing moetext never chooses the platform for the user."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # a shared 2-core box: the 2-step run's compile dominates
ON_TPU = any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    assert out.returncode == 0, f"{cmd}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out


def _build_wheel(tmp: Path) -> Path:
    # From a copy of the sources: setuptools writes build/ and *.egg-info next to them. Offline:
    # the running environment's setuptools (requirements.txt), no index, no build isolation.
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("building the wheel needs setuptools (requirements.txt): bash setup.sh")
    proj = tmp / "proj"
    shutil.copytree(
        REPO / "src", proj / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, proj / name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, proj])
    (wheel,) = dist.glob("moetext-*.whl")
    shipped = REPO / "src/moetext/configs"
    want = {f"moetext/configs/{p.relative_to(shipped)}" for p in shipped.rglob("*.yml")}
    assert want and want <= set(zipfile.ZipFile(wheel).namelist()), want
    return wheel


def _venv_with_wheel(tmp: Path, wheel: Path, env: dict) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python]
    _run([*pip, "install", "-q", "--no-deps", "--no-index", wheel], env=env)
    # The dependencies come from the running environment, appended to sys.path after the new
    # venv's own site-packages so the wheel's moetext wins. A plain path line: that
    # environment's .pth files (its editable moetext) are not processed.
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([python, "-c", code], env=env).stdout.strip())
    deps = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (site / "zz_moetext_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    return python


def test_wheel_trains_two_steps_outside_the_repository(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    python = _venv_with_wheel(tmp_path, _build_wheel(tmp_path), env)
    work = tmp_path / "elsewhere"
    work.mkdir()

    code = "import moetext, train; print(moetext.__file__); print(train.__file__)"
    files = _run([python, "-c", code], cwd=work, env=env).stdout.split()
    venv = (tmp_path / "venv").resolve()
    assert all(Path(f).resolve().is_relative_to(venv) for f in files), files

    # The README's command, verbatim path: there is no configs/ here, so it names the shipped
    # config (and its base_config and sharding preset come from the package too).
    run_dir = tmp_path / "run"
    cmd = [
        python,
        "-m",
        "train",
        "configs/models/tiny-qwen3-moe.yml",
        "data.kind=synthetic",
        "train.steps=2",
        "train.log_every=1",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.peak_tflops=1.0",
        "checkpoint.enabled=false",
        f"train.run_dir={run_dir}",
    ]
    out = _run(cmd, cwd=work, env=env)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2], out.stdout
    assert (run_dir / "config.yml").is_file()
    assert not (work / "configs").exists()


def test_import_leaves_the_platform_to_jax(tmp_path):
    # Users: no JAX_PLATFORMS, so JAX picks a GPU or TPU when there is one. Off TPU, libtpu
    # (installed for AOT compiles) is only quietened, and prints nothing while JAX probes it.
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "JAX_PLATFORMS" and not k.startswith("TPU_") and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"
    }
    code = "import os, moetext, jax; jax.devices(); print(os.environ.get('JAX_PLATFORMS'))"
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert out.stdout.strip() == "None"
    if not ON_TPU:
        for noise in ("TPU_", "libtpu", "InitGoogle"):
            assert noise not in out.stderr, out.stderr
