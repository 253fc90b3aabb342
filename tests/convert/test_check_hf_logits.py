"""scripts/check_hf_logits.py compare: moetext's logits against transformers' stored ones (the
fixtures' input_ids.npy + logits.npy are transformers references), from an HF directory and from
a real hf-to-orbax conversion; a perturbed reference fails naming the prompt and the diff; bad
input is one `error:` line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fake_devices import xla_flags
from moetext.convert.hf_to_orbax import hf_to_orbax

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "hf"
SCRIPT = REPO / "scripts" / "check_hf_logits.py"
sys.path.insert(0, str(REPO / "scripts"))

import check_hf_logits as chk  # noqa: E402

MAX_DIFF = re.compile(r"max \|diff\| ([0-9.e+-]+) at position (\d+)")


def _main(capsys, *args: str) -> tuple[int, str, str]:
    code = chk.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _ref_copy(tmp_path: Path, name: str = "dense_first_t5") -> Path:
    ref = tmp_path / "ref"
    ref.mkdir()
    for f in (chk.IDS, chk.LOGITS):
        shutil.copy(FIXTURES / name / f, ref / f)
    return ref


@pytest.mark.parametrize("name", ["dense_first_t5", "sparse_step_released", "qwen2_shared_expert"])
def test_hf_dir_matches_the_fixture_reference(capsys, name):
    d = FIXTURES / name
    code, out, err = _main(
        capsys,
        "compare",
        "--checkpoint",
        str(d),
        "--reference",
        str(d),
        "kernels.gmm_backend=reference",
    )
    assert code == 0, out + err
    lines = out.splitlines()
    assert (
        lines[-1]
        == "ok: 2 prompts within atol 0.05 with top-1 agreement >= 0.9 (float32 reference)"
    )
    diffs = [float(m.group(1)) for line in lines if (m := MAX_DIFF.search(line))]
    assert len(diffs) == 2 and lines[0].startswith("prompt 0 (12 tokens)")
    # float32 on both sides: measured <= 4e-6 (tests/convert/test_hf.py bounds it by 1e-4).
    assert max(diffs) <= 1e-4, diffs
    assert "top-1 agree 1.000" in lines[0] and "top-1 agree 1.000" in lines[1]


def test_converted_checkpoint_through_the_cli_and_a_perturbed_reference_fails(tmp_path, capsys):
    src = FIXTURES / "sparse_step_released"
    hf_to_orbax(src, tmp_path / "ckpt")
    capsys.readouterr()  # the conversion's warning: the fixture has no tokenizer
    ref = _ref_copy(tmp_path, "sparse_step_released")

    def cli(*extra: str, devices: int = 1) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(SCRIPT), "compare", "--checkpoint", str(tmp_path / "ckpt")]
        cmd += ["--reference", str(ref), *extra]
        env = {**os.environ, "XLA_FLAGS": xla_flags(devices)}
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )

    # Sharded as a TPU host would run it: 4 devices, experts split 2 ways, the 2 rows padded
    # to the 4 batch shards.
    ok = cli("sharding.preset=fsdp_ep", "sharding.mesh.expert=2", devices=4)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("ok: 2 prompts within atol 0.05")
    assert all(float(m.group(1)) <= 1e-4 for m in MAX_DIFF.finditer(ok.stdout))

    logits = np.load(ref / chk.LOGITS)
    logits[1, 7, 3] += 0.5  # one logit of row 1, position 7: a diff of ~0.5 there
    np.save(ref / chk.LOGITS, logits)
    bad = cli()
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failed = [line for line in bad.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "prompt 0" not in failed[0], bad.stdout
    m = re.fullmatch(
        r"FAILED prompt 1 \(12 tokens\): max \|diff\| (0\.\d+) at position 7 \(atol 0\.05\), "
        r"top-1 agree [01]\.\d+ \(min 0\.9\)",
        failed[0],
    )
    assert m is not None and abs(float(m.group(1)) - 0.5) < 1e-3, failed[0]
    assert "Traceback" not in bad.stderr
    # The same diff passes a looser --atol: the bound is the option's, not a constant.
    ckpt = str(tmp_path / "ckpt")
    assert (
        _main(capsys, "compare", "--checkpoint", ckpt, "--reference", str(ref), "--atol", "0.6")[0]
        == 0
    )

    # The config comes from CKPT/config.yml (or --config, or the run's RUN_DIR/config.yml).
    (tmp_path / "ckpt" / "config.yml").rename(tmp_path / "saved.yml")
    line = _error(capsys, "--checkpoint", ckpt, "--reference", str(ref))
    assert f"no config for {ckpt}: looked for {ckpt}/config.yml" in line
    args = ("--checkpoint", ckpt, "--reference", str(ref), "--atol", "0.6")
    assert _main(capsys, "compare", *args, "--config", str(tmp_path / "saved.yml"))[0] == 0
    saved = str(tmp_path / "saved.yml")
    line = _error(capsys, *args, "--config", saved, "model.vocab_size=81")
    assert (
        f"model.vocab_size=81 ({saved} with the overrides) but the reference logits have vocab 80"
        in line
    )
    line = _error(capsys, *args, "--config", saved, "model.emb_dim=64")
    assert (
        "does not fit this run's model: model.emb_dim: the checkpoint has 32, this run 64" in line
    )


def test_a_bfloat16_reference_gets_its_own_default_bounds(tmp_path, capsys):
    ref = _ref_copy(tmp_path)
    (ref / chk.META).write_text(json.dumps({"dtype": "bfloat16"}))
    d = str(FIXTURES / "dense_first_t5")
    code, out, _ = _main(capsys, "compare", "--checkpoint", d, "--reference", str(ref))
    assert code == 0
    assert out.splitlines()[-1].endswith("atol 4 with top-1 agreement >= 0.8 (bfloat16 reference)")
    (ref / chk.META).write_text(json.dumps({"dtype": "float16"}))
    line = _error(capsys, "--checkpoint", d, "--reference", str(ref))
    assert "dtype 'float16' is not one of float32, bfloat16" in line


def test_top1_agreement_and_reference_dtype_set_the_verdict(tmp_path):
    ids = np.zeros((2, 4), np.int32)
    ref_logits = np.tile(np.arange(5, dtype=np.float32), (2, 4, 1))  # argmax 4 everywhere
    ref = tmp_path / "ref"
    ref.mkdir()
    np.save(ref / chk.IDS, ids)
    np.save(ref / chk.LOGITS, ref_logits)
    (ref / chk.META).write_text(
        json.dumps({"prompts": ["a", "b"], "lengths": [4, 2], "dtype": "bfloat16"})
    )
    r = chk.read_reference(str(ref))
    assert (
        r.dtype == "bfloat16" and r.lengths == [4, 2] and chk.TOLERANCES["bfloat16"] == (4.0, 0.8)
    )
    got = ref_logits.copy()
    got[0, 1, 0] = 4.5  # row 0 position 1: argmax moves to 0 (diff 4.5)
    got[1, 3, :] = 99.0  # row 1 position 3 is padding (length 2): never compared
    rows = chk.compare_logits(got, r, atol=5.0, min_top1=0.8)
    assert [x.positions for x in rows] == [4, 2]
    assert rows[0].top1 == 0.75 and rows[0].max_diff == 4.5 and rows[0].at == 1
    assert not rows[0].passed  # 3 of 4 agree < 0.8
    assert rows[1].passed and rows[1].max_diff == 0.0 and rows[1].top1 == 1.0
    assert rows[0].kl > 0 and rows[1].kl == 0.0
    assert chk.compare_logits(got, r, atol=5.0, min_top1=0.75)[0].passed
    assert not chk.compare_logits(got, r, atol=4.0, min_top1=0.0)[0].passed
    nan = got.copy()
    nan[1, 0, 0] = np.nan
    assert not chk.compare_logits(nan, r, atol=1e9, min_top1=0.0)[1].passed


def _error(capsys, *args: str) -> str:
    code, out, err = _main(capsys, "compare", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def test_bad_input_is_one_error_line(tmp_path, capsys):
    fixture = str(FIXTURES / "dense_first_t5")
    ref = _ref_copy(tmp_path)
    (ref / chk.LOGITS).unlink()
    assert "has no logits.npy" in _error(capsys, "--checkpoint", fixture, "--reference", str(ref))
    assert "is not a directory" in _error(
        capsys, "--checkpoint", fixture, "--reference", str(tmp_path / "nope")
    )

    logits = np.load(FIXTURES / "dense_first_t5" / chk.LOGITS)
    np.save(ref / chk.LOGITS, logits[:, :11])
    line = _error(capsys, "--checkpoint", fixture, "--reference", str(ref))
    assert "has shape [2, 11, 96]; input_ids.npy is [2, 12], so expected [2, 12, vocab]" in line

    np.save(ref / chk.LOGITS, logits[..., :95])
    line = _error(capsys, "--checkpoint", fixture, "--reference", str(ref))
    assert (
        f"model.vocab_size=96 ({fixture}/config.json) but the reference logits have vocab 95"
        in line
    )

    np.save(ref / chk.LOGITS, logits)
    (ref / chk.META).write_text(json.dumps({"lengths": [12, 13]}))
    assert "lengths [12, 13] must be 2 values in [1, 12]" in _error(
        capsys, "--checkpoint", fixture, "--reference", str(ref)
    )
    (ref / chk.META).unlink()

    ids = np.load(ref / chk.IDS)
    ids[0, 0] = 96
    np.save(ref / chk.IDS, ids)
    assert "token ids in [" in _error(capsys, "--checkpoint", fixture, "--reference", str(ref))
    shutil.copy(FIXTURES / "dense_first_t5" / chk.IDS, ref / chk.IDS)

    (tmp_path / "empty").mkdir()
    line = _error(capsys, "--checkpoint", str(tmp_path / "empty"), "--reference", str(ref))
    assert "neither a moetext checkpoint" in line
    line = _error(capsys, "--checkpoint", fixture, "--reference", str(ref), "model.num_layers=2")
    assert "takes only kernels.* overrides, got model.num_layers=2" in line
    line = _error(capsys, "--checkpoint", fixture, "--reference", str(ref), "kernels.gmm_backnd=x")
    assert "gmm_backnd" in line


def test_reference_without_torch_says_what_it_needs(tmp_path, capsys):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: the reference step would run")
    d = FIXTURES / "dense_first_t5"
    code, _, err = _main(
        capsys, "reference", "--hf", str(d), "--out", str(tmp_path / "r"), "--ids", str(d / chk.IDS)
    )
    assert code == 2 and err.startswith("error: reference needs torch and transformers"), err
    code, _, err = _main(
        capsys, "reference", "--hf", str(d), "--out", str(tmp_path), "--ids", str(tmp_path / "x")
    )
    assert code == 2 and err == f"error: --ids {tmp_path / 'x'} does not exist\n"
    assert not (tmp_path / "r").exists()
