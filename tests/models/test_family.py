"""Model families: one defined in this file alone is registered and trained by the real loop;
every family's declared counts and logical axes are what its built model really has; a family
with state outside the gradient (model_state_family.py) keeps it out of the optimizer, skips
it with a non-finite step, and resumes it bit-exactly after kill -9."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx
from model_state_family import CountingLM
from tiny_configs import KERNELS, TINY_MOE, tiny, tiny_deepseek

from fake_devices import running
from moetext import config, models, program, train
from moetext import data as data_lib
from moetext.checkpoint import Checkpointer, CheckpointError, abstract_like
from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.models.flops import dot_product_attention_flops
from moetext.models.layers.attention import Attention
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.rope import rope_cos_sin
from moetext.models.moe.block import AUX_KEYS, LOAD_KEY, MoEBlock
from moetext.models.moe.experts import gmm_from_config
from moetext.sharding import plan as sharding_plan
from moetext.train import resume

REPO = Path(__file__).resolve().parents[2]
TINY_YML = REPO / "configs/models/tiny-qwen3-moe.yml"


def toy_yml(tmp_path: Path, family: str) -> Path:
    """The tiny config for `family`: the same file without its Qwen-only fields (the test
    families read the shared model/moe sections only)."""
    raw = yaml.safe_load(TINY_YML.read_text())
    raw["base_config"] = str(TINY_YML.parent / raw["base_config"])
    raw["model"] = {k: v for k, v in raw["model"].items() if k != "qk_norm"} | {"family": family}
    path = tmp_path / f"{family}.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


# --- A toy family, defined here only: parallel attention + MoE (GPT-J / PaLM style) --------
# x + attn(norm(x)) + moe(norm(x)) with one norm per layer, MoE in every even layer (the odd
# layers are attention only), the LM head tied to the embedding.


def _toy_pattern(m: ModelConfig) -> tuple[bool, ...]:
    return tuple(i % 2 == 0 for i in range(m.num_layers))


class ParallelLayer(nnx.Module):
    def __init__(self, m: ModelConfig, moe: MoEConfig, gmm, *, use_moe: bool, rngs: nnx.Rngs):
        pdt = as_dtype(m.param_dtype)
        self.norm = RMSNorm(m.emb_dim, eps=m.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(m, qk_norm=True, rngs=rngs)
        self.moe = (
            MoEBlock(
                moe,
                gmm,
                emb_dim=m.emb_dim,
                init_std=m.init_std,
                param_dtype=pdt,
                dtype=as_dtype(m.dtype),
                rngs=rngs,
            )
            if use_moe
            else None
        )

    def __call__(self, x, cos, sin, seg):
        h = self.norm(x)
        out = x + self.attn(h, cos, sin, seg)
        if self.moe is None:
            return out, None
        y, aux = self.moe(h)
        return out + y, aux


class ParallelLM(nnx.Module):
    def __init__(self, m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs):
        pdt, self.dtype, self.m = as_dtype(m.param_dtype), as_dtype(m.dtype), m
        gmm = gmm_from_config(k)
        self.embed = make_param(
            rngs, normal(m.init_std), (m.vocab_size, m.emb_dim), ("vocab", "embed"), pdt
        )
        self.layers = nnx.List(
            [ParallelLayer(m, moe, gmm, use_moe=u, rngs=rngs) for u in _toy_pattern(m)]
        )
        self.final_norm = RMSNorm(m.emb_dim, eps=m.rms_norm_eps, param_dtype=pdt, rngs=rngs)

    def __call__(self, tokens_BS, *, positions_BS=None, segment_ids_BS=None):
        b, s = tokens_BS.shape
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        cos, sin = rope_cos_sin(positions_BS, self.m.head_dim, self.m.rope_theta)
        x = jnp.take(self.embed[...], tokens_BS, axis=0).astype(self.dtype)
        auxes = []
        for layer in self.layers:
            x, aux = layer(x, cos, sin, segment_ids_BS)
            if aux is not None:
                auxes.append(aux)
        x = self.final_norm(x)
        logits = jnp.einsum("bsd,vd->bsv", x, self.embed[...].astype(self.dtype))
        out = {key: sum(a[key] for a in auxes) / len(auxes) for key in AUX_KEYS}
        out[LOAD_KEY] = jnp.stack([a[LOAD_KEY] for a in auxes])
        return logits.astype(jnp.float32), out


def _toy_counts(m: ModelConfig, moe: MoEConfig) -> models.ParamCounts:
    d, h = m.emb_dim, m.head_dim
    attn = d * m.num_heads * h * 2 + 2 * d * m.num_kv_heads * h + 2 * h  # q/k norms
    expert = 3 * d * moe.moe_intermediate_size
    n_moe = sum(_toy_pattern(m))
    embedding = m.vocab_size * d
    total = embedding + d + m.num_layers * (attn + d) + n_moe * (d * moe.num_experts)
    total += n_moe * moe.num_experts * expert
    active = total - n_moe * (moe.num_experts - moe.num_experts_per_tok) * expert
    return {"total": total, "active": active, "embedding": embedding}


def _toy_flops(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    c = _toy_counts(m, moe)
    # The tied table is gathered (no FLOPs) and used as the head matmul (D * V).
    nonembedding = c["active"] - c["embedding"] + m.emb_dim * m.vocab_size
    attention = dot_product_attention_flops(m.num_layers, m.num_heads, m.head_dim, seq_len)
    return 6 * nonembedding + attention


TOY = models.register_family(
    models.ModelFamily(
        name="toy_parallel",
        description="test-only parallel attention + MoE block, tied head",
        build=ParallelLM,
        moe_layers=_toy_pattern,
        count_params=_toy_counts,
        flops_per_token=_toy_flops,
        logical_axes=frozenset(
            {"batch", "length", "embed", "vocab", "heads", "kv_heads", "head_dim"}
            | {"norm", "exp", "mlp_moe"}
        ),
    )
)


def _param_counts(model: nnx.Module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _used_logical_axes(m: ModelConfig) -> set[str]:
    """Every logical name the family's params carry and its forward pass constrains."""
    model = nnx.eval_shape(lambda: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    names: set[str] = set()
    for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names.update(n for n in sharding_plan.logical_names(var) or () if n is not None)
    plan = sharding_plan.make_plan(config.load(TINY_YML).sharding, jax.devices()[:1])
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    with plan.rules(), sharding_plan.record_logical_names() as seen:
        jax.eval_shape(lambda t: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0))(t), tokens)
    return names | {n for n in seen if n is not None}


def test_toy_family_is_registered_and_built_by_name():
    assert "toy_parallel" in models.available_families()
    assert models.get_family("toy_parallel") is TOY
    m = tiny(family="toy_parallel", num_layers=3)
    model = nnx.eval_shape(lambda: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    assert isinstance(model, ParallelLM)
    assert _param_counts(model) == TOY.count_params(m, TINY_MOE)["total"]
    # A second family of the same name is refused unless replaced on purpose.
    with pytest.raises(ValueError, match="'toy_parallel' is already registered"):
        models.register_family(dataclasses.replace(TOY, description="another"))


@pytest.mark.parametrize(
    ("m", "unused"),
    [
        (tiny(), {"layers"}),  # qwen3_moe: dense, MoE, MoE; "layers" is scan_layers' axis
        (tiny(scan_layers=True), set()),
        (tiny(family="dense"), {"layers"}),
        (tiny(family="toy_parallel"), set()),
        (tiny_deepseek(), {"layers"}),  # dense, MoE, MoE; MLA with q_lora
        (tiny_deepseek(scan_layers=True, q_lora_rank=None), {"q_lora"}),  # Moonlight's q
    ],
    ids=["qwen3_moe", "qwen3_moe-scan", "dense", "toy_parallel", "deepseek_v3", "deepseek_v3-scan"],
)
def test_declared_counts_and_logical_axes_are_the_built_models(m, unused):
    family = models.get_family(m.family)
    model = nnx.eval_shape(lambda: models.build(m, TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    assert family.count_params(m, TINY_MOE)["total"] == _param_counts(model)
    assert len(family.moe_layers(m)) == m.num_layers
    assert family.logical_axes - _used_logical_axes(m) == unused
    assert _used_logical_axes(m) <= family.logical_axes


def test_a_family_defined_in_a_test_trains_through_the_real_loop(tmp_path):
    cfg = config.load(
        toy_yml(tmp_path, "toy_parallel"),
        [
            "model.num_layers=3",
            "data.kind=synthetic",
            "train.steps=40",
            "train.log_every=10",
            "train.eval_every=0",
            "train.progress_bar=false",
            "train.peak_tflops=1.0",
            "checkpoint.enabled=false",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )
    last = train.run(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [10, 20, 30, 40]
    # log(512) = 6.24 nats at init; the synthetic Markov chain is learnable.
    assert losses[40] < losses[10] - 0.5 and np.isfinite(list(losses.values())).all(), losses
    # expert_load rows are labelled with the family's MoE layers (0 and 2), not Qwen's rule.
    assert {k for k in rows[-1] if k.startswith("expert_imbalance/")} == {
        "expert_imbalance/layer_0",
        "expert_imbalance/layer_2",
    }
    # MFU used the family's own FLOP count.
    fpt = TOY.flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
    assert last["mfu"] == pytest.approx(fpt * last["tokens_per_s"] / 1e12, rel=1e-6)


def test_a_logical_axis_the_preset_lacks_fails_before_anything_is_built(tmp_path):
    odd = models.register_family(
        dataclasses.replace(TOY, name="toy_odd_axis", logical_axes=TOY.logical_axes | {"toy_axis"})
    )
    cfg = config.load(toy_yml(tmp_path, odd.name), ["data.kind=synthetic"])
    with pytest.raises(ConfigError, match=r"'toy_axis' of model family 'toy_odd_axis'"):
        program.build(cfg)


# --- State outside the gradient: model_state_family.py's step counter and load sum ----------

COUNTER = [
    "model.family=toy_counter",
    "data.kind=synthetic",
    "train.progress_bar=false",
    "train.peak_tflops=1.0",
    "train.eval_every=0",
    "train.tensorboard=false",
    # Large enough that decaying the model state (were the optimizer to see it) would show.
    "optim.weight_decay=0.5",
    "optim.learning_rate=0.01",
    "optim.warmup_steps=0",
]


def _zeros_batch(cfg) -> dict[str, np.ndarray]:
    batch = {k: np.zeros((8, cfg.data.seq_len + 1), np.int32) for k in ("tokens", "positions")}
    batch["segment_ids"] = np.ones_like(batch["tokens"])
    return batch


@pytest.mark.parametrize(
    "extra",
    [[], ["train.separate_update=true"], ["train.grad_accum_steps=2"]],
    ids=["one_program", "separate_update", "grad_accum"],
)
def test_model_state_is_updated_by_the_step_and_never_by_the_optimizer(extra):
    cfg = config.load(TINY_YML, [*COUNTER, "train.skip_nonfinite_steps=1", *extra])
    b = program.build(cfg, jax.devices()[:1])
    model = nnx.eval_shape(lambda: program.create_model(cfg))
    assert isinstance(model, CountingLM) and isinstance(model, models.ModelStateLM)
    assert set(b.state.model_state) == {"steps", "load_sum"} and "steps" not in b.state.params
    # The optimizer state mirrors the params only: no path in it names a model-state variable.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(b.state)]
    assert [p for p in paths if "steps" in p or "load_sum" in p] == [
        ".model_state['load_sum'].value",
        ".model_state['steps'].value",
    ], paths
    step = program.jit_train_step(b)
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    batches = [program.put_batch(data.next_batch(), b.batch_sharding) for _ in range(3)]
    state, loads, counted = b.state, [], []
    with b.plan.rules():
        for batch in batches:
            state, m = step(state, batch)
            loads.append(np.asarray(m["expert_load"]))
            counted.append(float(m["counted_steps"]))
    # The forward read the count before each step; the update counted each step once.
    assert counted == [0.0, 1.0, 2.0] and int(state.model_state["steps"].get_value()) == 3
    # The sum of the step's aux expert_load, in float32 and in order: no decay, no gradient.
    want = np.zeros_like(loads[0])
    for load in loads:
        want = want + load
    np.testing.assert_array_equal(np.asarray(state.model_state["load_sum"].get_value()), want)

    # A non-finite step keeps the model state it started from, like params and optimizer state.
    leaves, treedef = jax.tree.flatten(state.params)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    poisoned = state.replace(params=jax.tree.unflatten(treedef, leaves))
    expect = jax.device_get(poisoned.model_state)
    with b.plan.rules():
        after, m = step(poisoned, program.put_batch(_zeros_batch(cfg), b.batch_sharding))
    assert int(m["skipped"]) == 1 and int(after.step) == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(after.model_state), expect)


def test_model_state_is_not_differentiated_and_eval_reads_it():
    from moetext.program.step import make_eval_step, make_loss_fn

    cfg = config.load(TINY_YML, COUNTER)
    b = program.build(cfg, jax.devices()[:1])
    batch = program.put_batch(_zeros_batch(cfg), b.batch_sharding)
    loss_fn = make_loss_fn(b.graphdef, b.rest)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    with b.plan.rules():
        (_, (_, aux, _, _)), grads = grad_fn(b.state.params, batch, b.state.model_state)
        seven = jax.tree.map(lambda x: x + 7, b.state.model_state)
        out = jax.jit(make_eval_step(b.graphdef, b.rest))(b.state.params, batch, seven)
    assert jax.tree.structure(grads) == jax.tree.structure(b.state.params)
    assert float(aux["counted_steps"]) == 0.0 and np.isfinite(float(out["eval_loss"]))


def test_model_state_is_saved_and_restored_with_the_train_state(tmp_path):
    cfg = config.load(
        TINY_YML,
        [
            *COUNTER,
            "train.steps=4",
            "train.log_every=2",
            "checkpoint.every=2",
            "checkpoint.async_save=false",
            f"train.run_dir={tmp_path}",
        ],
    )
    train.run(cfg)
    b = program.build(cfg, abstract=True)
    ckpt = Checkpointer(cfg.checkpoint, tmp_path)
    try:
        for step in (2, 4):
            state, _, _ = ckpt.restore(step, abstract_like(b.state))
            assert int(state.model_state["steps"].get_value()) == step == int(state.step)
    finally:
        ckpt.close()
    # Saved under a stable key beside the params: state/model_state/<module path>.
    meta = json.loads((tmp_path / "checkpoints/4/state/_METADATA").read_text())
    assert {k.split(",")[0].strip("('") for k in meta["tree_metadata"]} == {
        "step",
        "params",
        "opt_state",
        "rng",
        "model_state",
    }
    # A checkpoint and a model that disagree on having model state: one clear error first.
    resume.check_model_state(tmp_path / "checkpoints/4", b.state, "c")
    none = b.state.replace(model_state=nnx.State({}))
    with pytest.raises(
        CheckpointError, match=r"^c holds model_state, but this run's model has none"
    ):
        resume.check_model_state(tmp_path / "checkpoints/4", none, "c")
    old = tmp_path / "old"
    small = {"step": np.zeros((), np.int32), "params": {"w": np.ones(2, np.float32)}}
    ocp.PyTreeCheckpointer().save(old / "state", small)
    resume.check_model_state(old, none, "c")
    with pytest.raises(
        CheckpointError, match=r"c holds no model_state, but .* has load_sum, steps"
    ):
        resume.check_model_state(old, b.state, "c")


def _state_of(run_dir: Path, overrides: list[str], step: int) -> program.TrainState:
    cfg = config.load(TINY_YML, [*overrides, f"train.run_dir={run_dir}"])
    b = program.build(cfg, abstract=True)
    ckpt = Checkpointer(cfg.checkpoint, run_dir)
    try:
        state, _, _ = ckpt.restore(step, abstract_like(b.state))
    finally:
        ckpt.close()
    out: program.TrainState = jax.device_get(state)
    return out


@pytest.mark.slow
def test_model_state_survives_kill_9_and_resume_bit_exactly(tmp_path):
    same = [
        *COUNTER,
        "train.steps=16",
        "train.log_every=1",
        "checkpoint.every=4",
        "checkpoint.async_save=false",
    ]
    script = str(Path(__file__).with_name("model_state_family.py"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def cli(run_dir: Path) -> list[str]:
        return [sys.executable, script, str(TINY_YML), *same, f"train.run_dir={run_dir}"]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for d in (straight, killed):
        d.mkdir()
    ref = subprocess.run(
        cli(straight), cwd=straight, env=env, capture_output=True, text=True, timeout=600
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    with running(
        cli(killed), cwd=killed, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as proc:
        deadline = time.monotonic() + 300
        while not (killed / "checkpoints/4").is_dir():  # renamed there once complete
            assert proc.poll() is None, "the run ended before a checkpoint was written"
            assert time.monotonic() < deadline, "no checkpoint written in time"
            time.sleep(0.001)
        proc.kill()  # SIGKILL: no handler runs
        proc.wait(timeout=30)
    kept = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert kept and max(kept) < 16, kept
    again = subprocess.run(
        cli(killed), cwd=killed, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]

    rows = [json.loads(line) for line in open(killed / "metrics.jsonl")]
    compiled = [r["step"] for r in rows if r.get("event") == "compiled"]
    assert compiled == [0, max(kept)]  # resumed from the last checkpoint
    # The forward saw the count of steps before it, across the kill, in every row.
    assert [(r["step"], r["counted_steps"]) for r in rows if "loss" in r] == [
        (s, float(s - 1)) for s in range(1, 17)
    ]
    want = _state_of(straight, same, 16)
    got = _state_of(killed, same, 16)
    assert int(got.model_state["steps"].get_value()) == 16
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)
