"""hf -> orbax -> hf is bit-exact; the CLI refuses what would lose or half-write data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from moetext import config as config_lib
from moetext.config.loader import resolve_paths
from moetext.convert.hf_to_orbax import hf_to_orbax
from moetext.convert.orbax_to_hf import orbax_to_hf
from moetext.convert.safetensors_io import SafetensorsReader
from moetext.errors import ConfigError
from moetext.models.qwen3_moe.hf import config_from_hf

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "hf"


def _tensors(d: Path) -> dict[str, np.ndarray]:
    r = SafetensorsReader(d)
    return {n: np.asarray(r.get(n)) for n in r.names()}


@pytest.mark.parametrize(
    "name", ["dense_first_t5", "sparse_step_released", "qwen2_shared_expert", "qwen3_chat"]
)
def test_hf_orbax_hf_is_bit_exact(tmp_path, name):
    src = FIXTURES / name
    cfg = hf_to_orbax(src, tmp_path / "ckpt")
    saved = config_lib.load(tmp_path / "ckpt" / "config.yml")
    # Loading resolves the config's paths (train.run_dir) to absolute ones; nothing else moves.
    assert (
        saved == resolve_paths(cfg)
        and "base_config" not in (tmp_path / "ckpt/config.yml").read_text()
    )
    files = orbax_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=50_000)
    assert len(files) > 2 and files[-1].name == "model.safetensors.index.json"
    a, b = _tensors(src), _tensors(tmp_path / "hf")
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert a[n].tobytes() == b[n].tobytes(), n
    src_cfg = json.loads((src / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config_from_hf(src_cfg) == config_from_hf(out_cfg)
    for key in set(src_cfg) & set(out_cfg) - {"transformers_version"}:
        assert src_cfg[key] == out_cfg[key], key


def test_dtype_change_and_config_checks(tmp_path):
    src = FIXTURES / "dense_first_t5"
    hf_to_orbax(src, tmp_path / "bf16", dtype="bfloat16")
    orbax_to_hf(tmp_path / "bf16", tmp_path / "hf16")
    out = _tensors(tmp_path / "hf16")
    ref = _tensors(src)
    w = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert out[w].dtype.name == "bfloat16"
    assert np.array_equal(out[w].astype(np.float32), ref[w].astype("bfloat16").astype(np.float32))
    assert json.loads((tmp_path / "hf16/config.json").read_text())["torch_dtype"] == "bfloat16"

    # A --config must describe the checkpoint: every differing shape field is named.
    good = tmp_path / "good.yml"
    good.write_text(yaml.safe_dump(config_lib.to_dict(hf_to_orbax(src, tmp_path / "c1"))))
    raw = yaml.safe_load(good.read_text())
    raw["model"]["emb_dim"], raw["moe"]["num_experts"] = 64, 8
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"model.emb_dim: .* 64, config.json 32.*moe.num_experts"):
        hf_to_orbax(src, tmp_path / "c2", config_path=bad)
    assert not (tmp_path / "c2").exists()
    hf_to_orbax(src, tmp_path / "c3", config_path=good)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "moetext.convert", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_cli_refuses_to_overwrite_and_leaves_nothing_partial(tmp_path):
    src = FIXTURES / "sparse_step_released"
    out = tmp_path / "ckpt"
    r = _cli("hf-to-orbax", "--hf", str(src), "--out", str(out), "--emit_config")
    assert r.returncode == 0, r.stderr
    assert "num_experts: 6" in r.stdout and "no tokenizer.json" in r.stderr
    r = _cli("hf-to-orbax", "--hf", str(src), "--out", str(out))
    assert r.returncode == 2 and "pass --overwrite to replace it" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # one line, no traceback
    assert _cli("hf-to-orbax", "--hf", str(src), "--out", str(out), "--overwrite").returncode == 0

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "model-00003-of-00005.safetensors").unlink()
    r = _cli("hf-to-orbax", "--hf", str(broken), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "model-00003-of-00005.safetensors" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "ckpt"]  # nothing staged

    r = _cli("orbax-to-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "--checkpoint" in r.stderr and "no such file" in r.stderr
    r = _cli("orbax-to-hf", "--checkpoint", str(broken), "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "is not a moetext checkpoint" in r.stderr


def test_tokenizer_files_travel_both_ways(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from moetext.data.tokenizer import load_tokenizer

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "dense_first_t5", src)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<|endoftext|>", "<unk>"])
    tok.train_from_iterator(["hello world, a tiny corpus"] * 10, trainer)
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf_to_orbax(src, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt/tokenizer").iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    orbax_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes()
    ids = load_tokenizer(str(tmp_path / "hf")).encode("hello world")
    assert ids == load_tokenizer(str(src)).encode("hello world")


def test_a_run_with_an_hf_tokenizer_exports_it_with_its_chat_template(tmp_path):
    """A run's step directory (no tokenizer/ of its own) exports RUN_DIR/tokenizer, which a run
    prepared with an HF tokenizer holds as tokenizer.json + tokenizer_config.json (the chat
    template): a user serving the export elsewhere gets the tokenizer and template it was
    trained with."""
    from moetext.data.chat_template import load_chat_template
    from moetext.data.tokenizer import load_tokenizer

    src = FIXTURES / "qwen3_chat"
    hf_to_orbax(src, tmp_path / "ckpt")
    run = tmp_path / "run"
    shutil.copytree(
        tmp_path / "ckpt", run / "checkpoints" / "7", ignore=shutil.ignore_patterns("tokenizer")
    )
    load_tokenizer(str(src)).save(str(run / "tokenizer"))  # as data.save_tokenizer does
    orbax_to_hf(run / "checkpoints" / "7", tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes(), name
    assert "chat_template" in json.loads((tmp_path / "hf/tokenizer_config.json").read_text())
    conv = [{"role": "user", "content": "3+5?"}, {"role": "assistant", "content": "8"}]
    got = load_chat_template(load_tokenizer(str(tmp_path / "hf")), None).render(conv)
    assert got == load_chat_template(load_tokenizer(str(src)), None).render(conv)
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n8<|im_end|>\n")  # Qwen3's
