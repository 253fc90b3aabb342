"""Typed, frozen configuration: one dataclass per component, one field docstring each.

A run's YAML decodes into `Config`; each component receives only its own slice
(`MoEBlock(cfg.moe, ...)`), never the whole tree. Each section checks its own values when it is
built (`__post_init__`, a ConfigError naming the field); checks that span sections live in
`moetext.config.validate`. Each field declares what a checkpoint's config must match
(`moetext.config.fields`: shapes_params, must_match, resume_safe, resume_safe_if).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from moetext import paths
from moetext.config import families
from moetext.config.fields import must_match, resume_safe, resume_safe_if, shapes_params
from moetext.config.moe_checks import check_routing
from moetext.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]


def _clipping_stays_on_or_off(old: float | None, new: float | None) -> bool:
    """A clipping threshold is a hyperparameter; turning clipping on or off adds or removes a
    stage (and its state) in the optimizer chain."""
    return (old is None) == (new is None)


def _same_tokenizer_path(old: str | None, new: str | None) -> bool:
    """The same file: checkpoints saved before paths were resolved at load time recorded the
    path as typed (relative, `~`); resolved here, it is the path this run resolved."""
    if old is None or new is None:
        return old is new
    return paths.resolve(old) == paths.resolve(new)


@dataclass(frozen=True)
class ModelConfig:
    family: str = shapes_params("qwen3_moe")
    """Model family registered in `moetext.models.family` (qwen3_moe, dense, deepseek_v3); it
    decides which further model/moe fields exist (its section classes:
    models/<family>/config.py)."""
    vocab_size: int = shapes_params(32000)
    """Vocabulary size (embedding rows and LM-head columns)."""
    emb_dim: int = shapes_params(256)
    """Hidden size D of the residual stream."""
    num_layers: int = shapes_params(2)
    """Number of decoder layers."""
    num_heads: int = shapes_params(4)
    """Number of query heads."""
    num_kv_heads: int = shapes_params(2)
    """Number of key/value heads (GQA); must divide num_heads."""
    head_dim: int = shapes_params(64)
    """Per-head dimension of q, k and v."""
    mlp_dim: int = shapes_params(1024)
    """Intermediate size of the dense SwiGLU MLP (dense layers only)."""
    rope_theta: float = shapes_params(1_000_000.0)
    """RoPE base frequency."""
    rms_norm_eps: float = shapes_params(1e-6)
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = shapes_params(False)
    """Share the token embedding with the LM head."""
    param_dtype: DType = must_match("float32")
    """Storage dtype of parameters (the optimizer's master copy)."""
    dtype: DType = must_match("bfloat16")
    """Compute dtype of activations and matmuls."""
    scan_layers: bool = must_match(False)
    """Run the layer stack with nnx.scan over stacked params (fast compile for deep models)."""
    remat_policy: Literal["none", "full", "save_dots"] = resume_safe("none")
    """Per-layer activation checkpointing: none, full (recompute all), save_dots (keep matmuls)."""
    attention_kernel: Literal["auto", "xla", "splash"] = resume_safe("auto")
    """Self-attention kernel: splash (Pallas splash attention: score blocks stay on chip, causal
    blocks skipped; interpreted off TPU), xla (plain XLA over blocks of 512 queries), auto: splash
    when running on or compiling for a TPU, else xla. Shapes splash cannot take (a length not a
    multiple of 128), decoding with a KV cache, and MLA (DeepSeek-V3) run on xla."""
    init_std: float = must_match(0.02)
    """Standard deviation of the normal initialiser for weight matrices and embeddings."""
    loss_chunk_size: int = resume_safe(8192)
    """Training/eval loss: LM head fused with the cross-entropy over vocab chunks of at most this
    many rows (with sharding.split_dense_gathers on a split mesh: a multiple of 128, at least
    128), never holding the [B*S, V] float32 logits (program/loss.py); 0: full logits. Each
    chunk adds a pass over the float32 [B*S, D] hidden-state gradient: 8192 (19 chunks for a
    151936 vocabulary) moves 17 GB fewer HBM bytes per Qwen3-30B-A3B step on v5p-64 than 2048
    (128 chunks), at less memory (docs/performance.md)."""
    loss_chunks: Literal["auto", "vocab", "tokens"] = resume_safe("auto")
    """How the fused loss (loss_chunk_size > 0) chunks: vocab (chunks of loss_chunk_size vocab
    rows, the backward recomputes their logits: four head matmuls), tokens (chunks of up to 64
    MiB of float32 logits over the whole vocabulary, the gradient formed in the forward: three
    head matmuls and a [V, D] float32 gradient held until the backward; not under
    split_dense_gathers), auto: tokens when the step runs on a CPU, else vocab
    (program/loss.py)."""

    def __post_init__(self) -> None:
        _positive(
            "model",
            vocab_size=self.vocab_size,
            emb_dim=self.emb_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        if self.loss_chunk_size < 0:
            raise ConfigError(
                f"model.loss_chunk_size must be >= 0 (0: the full-logits loss), got "
                f"{self.loss_chunk_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads="
                f"{self.num_kv_heads}: grouped-query attention needs whole groups"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even for RoPE")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = shapes_params(8)
    """Number of routed experts E."""
    num_experts_per_tok: int = shapes_params(2)
    """Experts per token K (top-k); at most num_experts."""
    router: str = shapes_params("softmax_topk")
    """Registered router that picks each token's K experts and their weights (models/moe/routers:
    softmax_topk)."""
    moe_intermediate_size: int = shapes_params(512)
    """Intermediate size F of each routed expert."""
    norm_topk_prob: bool = shapes_params(True)
    """Renormalise the top-k routing weights to sum to one (Qwen3)."""
    num_shared_experts: int = shapes_params(0)
    """Always-on shared experts (fused into one SwiGLU of width n * shared_intermediate_size)."""
    shared_intermediate_size: int = shapes_params(0)
    """Intermediate size of each shared expert (0 means moe_intermediate_size)."""
    aux_loss_weight: float = resume_safe(0.001)
    """Weight of the Switch-style load-balancing loss E * sum_e f_e * p_e."""
    z_loss_weight: float = resume_safe(0.0)
    """Weight of the router z-loss mean(logsumexp(logits)^2); 0 disables it."""
    dispatch: Literal["dropless", "capacity"] = must_match("dropless")
    """dropless: sort-based grouped matmul; capacity: fixed per-expert buffers (drop overflow)."""
    capacity_factor: float = must_match(1.25)
    """Capacity dispatch only: slots per expert = ceil(capacity_factor * T * K / E)."""
    ep_buffer_factor: float = resume_safe(0.0)
    """Expert parallelism (dropless dispatch with the experts split over mesh axes): each
    shard's receive buffer holds ceil(factor * its own t*K rows) rows, rounded up to 8;
    assignments past it are dropped (output 0; dropped_fraction reports them). 1.0 fits
    balanced routing exactly. 0: the worst case (expert shards x t*K rows), nothing dropped."""
    routed_scaling_factor: float = must_match(1.0)
    """Multiplies the routed experts' weights after any renormalisation (DeepSeek-V3: 2.5)."""
    n_group: int = must_match(1)
    """Expert groups for group-limited routing (DeepSeek-V2/V3); 1: no groups. Must divide
    num_experts, with at least 2 experts per group."""
    topk_group: int = must_match(1)
    """With n_group > 1: each token picks its experts among its topk_group best groups (a
    sigmoid router scores a group by the sum of its two highest biased scores, a softmax router
    by its highest probability)."""
    bias_update_rate: float = resume_safe(0.0)
    """Auxiliary-loss-free balancing (sigmoid_topk): after each step, selection_bias_e += rate *
    sign(mean load - load_e) over the global batch's non-padding tokens; 0 keeps the bias."""
    initial_bias: tuple[float, ...] = resume_safe(())
    """The selection bias a new run starts from, one value per expert; empty: zeros."""
    aux_loss_scope: Literal["micro_batch", "sequence", "global_batch"] = must_match("micro_batch")
    """Where the balance loss counts expert load: micro_batch (each micro-batch's tokens),
    sequence (DeepSeek-V3's sequence-wise loss, per packed document) or global_batch (loads
    accumulated over the step's micro-batches so far)."""
    routing_override: Literal["none", "balanced", "random"] = must_match("none")
    """Benchmarks: replace the router's choice by a perfectly balanced one (token t -> experts
    (t*K + j) mod E) or K distinct random experts per token, weights 1/K; none: route."""

    def __post_init__(self) -> None:
        _positive(
            "moe",
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            n_group=self.n_group,
            topk_group=self.topk_group,
        )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"moe.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"moe.num_experts={self.num_experts}: a token cannot pick more experts than exist"
            )
        if self.capacity_factor <= 0:
            raise ConfigError(f"moe.capacity_factor must be positive, got {self.capacity_factor}")
        if self.ep_buffer_factor < 0:
            raise ConfigError(
                f"moe.ep_buffer_factor must be >= 0 (0: the worst-case buffer, nothing "
                f"dropped), got {self.ep_buffer_factor}"
            )
        if self.ep_buffer_factor and self.dispatch != "dropless":
            raise ConfigError(
                f"moe.ep_buffer_factor={self.ep_buffer_factor} bounds the expert-parallel "
                f"dropless dispatch; moe.dispatch={self.dispatch!r} has its own capacity_factor"
            )
        check_routing(self)


@dataclass(frozen=True)
class KernelsConfig:
    gmm_backend: str = resume_safe("auto")
    """Grouped-matmul backend (`moetext.kernels.gmm.available_backends()`); auto: by platform."""
    checked: bool = resume_safe(False)
    """Verify at run time that group sizes are non-negative and sum to at most M (debug)."""
    tiling: tuple[int, int, int] | None = resume_safe(None)
    """Fixed (tm, tk, tn) tiles for tiled backends; None uses each backend's defaults."""
    quantization: str = resume_safe("none")
    """Quantization recipe around the gmm backend (`moetext.kernels.available_recipes()`): none,
    fp8_blockwise (1x128 block scales, FP8 fwd and bwd, Pallas FP8 kernels on TPU) or
    fp8_tensorwise (one scale per tensor and expert weight, any backend's own gmm)."""
    recipe: dict[str, Any] = resume_safe(default_factory=dict)
    """Options of the quantization recipe, e.g. {block_size: 128, weight_block: 128x128,
    bwd_quantize: auto, qag: true} for fp8_blockwise (docs/kernels.md lists each recipe's);
    an unknown option fails at model build, naming the nearest valid one."""
    fuse_gate_up: bool | Literal["auto"] = resume_safe("auto")
    """Run the experts' gate and up projections as one gmm on [w_gate | w_up]: xs is read (and
    under FP8 quantized and kept) once, and its gradient comes out of one gmm instead of two
    summed; the weight gradient is one [E, D, 2F] array. auto = fused exactly when
    kernels.quantization is on; the Qwen3 pod configs set true (fewer HBM bytes per step on
    v5p, docs/performance.md "TPU step cost")."""
    grad_reduce_dtype: Literal["param", "bfloat16"] = resume_safe("param")
    """dtype of the reduce-scatter of sharded expert-weight gradients: param (the weights'
    dtype, f32 by default) or bfloat16 (half the bytes and the full-size gradient buffer; what
    the shipped pod model configs set, as MaxText reduces)."""
    decode_moe: Literal["auto", "fused", "loop"] = resume_safe("auto")
    """The routed experts of a decoding (prefused) MoE layer with at most 256 rows: fused (one
    Pallas TPU kernel reading each active expert's weights once; interpreted off TPU), loop (a
    loop over the (token, expert) rows for T*K <= E, else grouped matmuls); auto: fused when
    running on or compiling for a TPU, F is a multiple of 128 and the sharding rules split the
    expert weights along E and/or D only (fsdp, fsdp_ep), else loop. Prefill (more rows) always
    takes the grouped matmuls."""
    regather_weights: bool = must_match(False)
    """All-gather FSDP-sharded expert weights again in the backward instead of keeping the
    forward's gathered copy: less memory per chip (Qwen3-30B-A3B on v5p:4x4x2: 18.51 -> 17.36
    GiB), 1.5x the expert-weight all-gather bytes. kernels.quantization none only."""

    def __post_init__(self) -> None:
        if self.recipe and self.quantization == "none":
            raise ConfigError(
                f"kernels.recipe sets {', '.join(sorted(self.recipe))} but "
                f"kernels.quantization is 'none': name the recipe these options belong to, "
                f"e.g. kernels.quantization=fp8_blockwise"
            )
        if self.regather_weights and self.quantization != "none":
            raise ConfigError(
                f"kernels.regather_weights=true is implemented for kernels.quantization=none "
                f"only, got kernels.quantization={self.quantization!r}"
            )


@dataclass(frozen=True)
class DataConfig:
    kind: Literal["synthetic", "tfds", "chat"] = must_match("synthetic")
    """Data source. tfds: a dataset prepared by `python -m moetext.data.prepare`, read with
    grain and packed; chat: conversations prepared with `--format chat`, rendered with a chat
    template, loss on assistant turns; synthetic: seeded token sequences with learnable
    structure (benchmarks)."""
    name: str | None = must_match(None)
    """tfds and chat: the prepared dataset's name under data_dir; python_docs is the embedded
    corpus (CPython's docs and docstrings), prepared automatically on first use."""
    data_dir: str | None = resume_safe(None)
    """tfds and chat: where prepared datasets live; None: $MOETEXT_DATA_DIR or
    ~/.cache/moetext/data."""
    tokenizer: str | None = resume_safe_if(None, when=_same_tokenizer_path)
    """tfds and chat: a sentencepiece .model or a Hugging Face tokenizer.json (or its directory);
    None uses the tokenizer saved beside the dataset. A resumed run keeps the same file."""
    train_split: str = must_match("train")
    """tfds and chat: split to train on."""
    eval_split: str = resume_safe("eval")
    """tfds and chat: split the evaluation batches come from."""
    shuffle: bool = must_match(True)
    """tfds and chat: visit documents in a seeded order, reshuffled every epoch."""
    prefetch: int = resume_safe(2)
    """tfds and chat: batches prepared ahead in a background thread."""
    seq_len: int = must_match(256)
    """Tokens per row (each row holds seq_len + 1 so inputs and targets are seq_len long)."""
    global_batch_size: int = must_match(4)
    """Sequences per step across all devices; must be divisible by the number of devices."""
    seed: int = must_match(0)
    """Seed of the data stream (independent from the model seed)."""
    eval_batches: int = resume_safe(2)
    """Held-out batches per evaluation (the same batches every time)."""
    train_on: Literal["assistant", "all"] = must_match("assistant")
    """chat only: the tokens that carry loss: each assistant turn's content and end-of-turn
    token (assistant), or every token of the conversation (all)."""
    chat_template: str | None = must_match(None)
    """chat only: a jinja chat template file; None: the tokenizer's own (chat_template.jinja
    or tokenizer_config.json beside it), else the built-in ChatML template."""
    overlong: Literal["truncate", "drop"] = must_match("truncate")
    """chat only: a conversation longer than seq_len + 1 tokens is cut after its last
    assistant turn that fits (truncate; dropped when none fits) or dropped (drop)."""

    def __post_init__(self) -> None:
        _positive("data", seq_len=self.seq_len, global_batch_size=self.global_batch_size)
        if self.kind in ("tfds", "chat") and not self.name:
            raise ConfigError(
                f"data.kind={self.kind!r} needs data.name: the dataset prepared with "
                "`python -m moetext.data.prepare --name NAME`, or python_docs (the embedded corpus)"
            )
        if self.prefetch < 1:
            raise ConfigError(f"data.prefetch must be >= 1, got {self.prefetch}")


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = resume_safe(3e-4)
    """Peak learning rate after warmup."""
    warmup_steps: int = resume_safe(10)
    """Linear warmup steps from 0 to learning_rate."""
    decay_steps: int | None = resume_safe(None)
    """Cosine decay length after warmup; None decays over the remaining train.steps."""
    min_lr_ratio: float = resume_safe(0.1)
    """Final learning rate as a fraction of the peak."""
    b1: float = resume_safe(0.9)
    """AdamW beta1."""
    b2: float = resume_safe(0.95)
    """AdamW beta2."""
    eps: float = resume_safe(1e-8)
    """AdamW epsilon."""
    weight_decay: float = resume_safe(0.1)
    """Decoupled weight decay, applied to weight matrices only (never norms)."""
    clip_norm: float | None = resume_safe_if(1.0, when=_clipping_stays_on_or_off)
    """Global gradient-norm clipping threshold; None disables clipping."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = resume_safe(100)
    """Number of optimizer steps to run in total (a resumed run continues up to it)."""
    run_dir: str = resume_safe("runs/default")
    """Directory for the resolved config, metrics.jsonl and checkpoints."""
    seed: int = must_match(0)
    """Seed of parameter initialisation and any training randomness."""
    log_every: int = resume_safe(10)
    """Log metrics every N steps (and at the last step)."""
    eval_every: int = resume_safe(0)
    """Evaluate on held-out batches every N steps; 0 disables periodic evaluation."""
    peak_tflops: float | None = resume_safe(None)
    """Dense bf16 TFLOP/s of one device for MFU; None: published for its kind, else measured."""
    progress_bar: bool = resume_safe(True)
    """Show a progress bar on the terminal."""
    tensorboard: bool = resume_safe(True)
    """Also write the metrics (and per-layer expert load) as TensorBoard events in run_dir."""
    skip_nonfinite_steps: int = resume_safe(0)
    """0: a NaN/Inf loss or grad norm stops the run. N > 0: such a step leaves params and
    optimizer state unchanged (logged as skipped); more than N skips in a row stop the run."""
    profile_steps: tuple[int, int] | None = resume_safe(None)
    """[start, stop]: write a jax.profiler trace of steps start..stop-1 (numbered as logged)
    under run_dir/tensorboard/ (TensorBoard's profile plugin, or Perfetto). None: no trace."""
    routing_trace: tuple[int, int] | None = resume_safe(None)
    """[start, stop]: for steps start..stop (inclusive, numbered as logged) write each MoE
    layer's chosen experts to run_dir/routing_trace/step_<n>.npz (key layer_<i>: int32
    [B, S, K] global expert ids; process 0). None: no trace."""
    profile_processes: tuple[int, ...] = resume_safe((0,))
    """Process indices that write the profiler trace (each host writes its own)."""
    grad_accum_steps: int = resume_safe(1)
    """Split each step's global batch into N micro-batches run one after another inside the
    step (gradients summed, one optimizer update): the same step with one micro-batch's
    activations in memory. N must divide data.global_batch_size."""
    log_batch_hash: bool = resume_safe(False)
    """Write `batch_hash`, a fingerprint of each step's global batch (whichever processes read
    it), to metrics.jsonl: shows that a resumed or moved run reads the batches an uninterrupted
    run reads. Costs a host-side hash and, with several processes, an all-gather per step."""
    freeze: tuple[str, ...] = must_match(())
    """Regexes: params whose "/"-joined unscanned name fully matches one (e.g.
    `layers/\\d+/mlp/router/w`, under either model.scan_layers) are not trained and have no
    optimizer state."""
    separate_update: bool = must_match(True)
    """Run the step as two jitted programs, the gradient then the optimizer update, instead of
    one: the same math with less peak memory on TPU, where one program holds a second copy of
    the layer scan's stacked gradient (Qwen3-30B-A3B on v5p:4x4x2: 18.51 vs 20.63 GiB per
    chip; docs/performance.md)."""
    compilation_cache_dir: str | None = resume_safe("auto")
    """Where `python -m train` and `python -m moetext.generate` keep compiled programs for the
    next run of the same programs (JAX's persistent compilation cache, in a subfolder per host
    CPU; moetext/compilation_cache.py). "auto": $MOETEXT_COMPILATION_CACHE_DIR, else
    $XDG_CACHE_HOME/moetext/jax_cache, else ~/.cache/moetext/jax_cache; a path; null: off."""

    def __post_init__(self) -> None:
        _positive("train", log_every=self.log_every, grad_accum_steps=self.grad_accum_steps)
        if self.steps < 0:
            raise ConfigError(f"train.steps must be >= 0, got {self.steps}")
        if self.skip_nonfinite_steps < 0:
            raise ConfigError(
                f"train.skip_nonfinite_steps must be >= 0, got {self.skip_nonfinite_steps}"
            )
        if self.profile_steps is not None:
            start, stop = self.profile_steps
            if not 1 <= start < stop:
                raise ConfigError(
                    f"train.profile_steps={[start, stop]} must be [start, stop] with "
                    f"1 <= start < stop (steps as the log numbers them, stop exclusive)"
                )
        if self.routing_trace is not None:
            start, stop = self.routing_trace
            if not 1 <= start <= stop:
                raise ConfigError(
                    f"train.routing_trace={[start, stop]} must be [start, stop] with "
                    f"1 <= start <= stop (steps as the log numbers them, stop inclusive)"
                )
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"train.freeze: {pattern!r} is not a regex: {e}") from None
        if any(i < 0 for i in self.profile_processes):
            raise ConfigError(
                f"train.profile_processes={list(self.profile_processes)} must hold process "
                f"indices >= 0"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = resume_safe(True)
    """Write orbax checkpoints under <run_dir>/checkpoints."""
    every: int = resume_safe(50)
    """Save every N steps (and at the last step)."""
    keep: int = resume_safe(3)
    """Keep the newest K checkpoints."""
    async_save: bool = resume_safe(True)
    """Write checkpoints in the background while training continues."""
    resume: bool = resume_safe(True)
    """Resume from the newest complete checkpoint in run_dir when one exists."""
    load_params_from: str | None = resume_safe(None)
    """A checkpoint directory (a run's checkpoints/<step>/ or `moetext.convert hf-to-orbax`
    output) whose params start a new run: step 0, fresh optimizer. Ignored on resume."""

    def __post_init__(self) -> None:
        _positive("checkpoint", every=self.every)
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class ShardingConfig:
    preset: str = resume_safe("fsdp")
    """Preset under configs/sharding/ (fsdp, fsdp_tp, fsdp_ep) or a path to a preset YAML file."""
    mesh: dict[str, int] = resume_safe(default_factory=dict)
    """Per-slice (ICI) axis sizes overriding the preset's; -1 fills with the remaining devices."""
    dcn_mesh: dict[str, int] = resume_safe(default_factory=dict)
    """Across-slice (DCN) axis sizes overriding the preset's; their product is the slice count."""
    split_dense_gathers: bool = must_match(False)
    """Run the dense layers' FSDP matmuls (attention, dense MLP, router, the fused loss's LM
    head) per token shard in a shard_map on the torus-split mesh, so that on a 3D TPU slice (or
    a whole square 2D one, 4x4 and up) their weight gathers and gradient reduce-scatters are
    per-axis all-gathers / reduce-scatters rather than GSPMD's one collective (an all-reduce
    from v5p:4x4x4 up; on v6e:16x16 the LM head's gradient keeps an all-reduce stage of 3 MiB
    per chunk). The LM head's vocab chunks are then a multiple of 128 rows. For weights split
    over the axes that split the tokens: fsdp, fsdp_ep (fsdp x expert, gathered one axis at a
    time where together they need the split), fsdp_tp with tensor = 1; no effect on CPU
    or other 2D slices. Off: GSPMD decides (docs/sharding.md, "3D TPU slices")."""


@dataclass(frozen=True)
class DistributedConfig:
    initialize: Literal["auto", "always", "never"] = resume_safe("auto")
    """jax.distributed.initialize: auto (num_processes > 1 or launcher env vars), always, never."""
    coordinator_address: str | None = resume_safe(None)
    """host:port of process 0; None: JAX_COORDINATOR_ADDRESS or auto-detect (TPU VM, SLURM)."""
    num_processes: int | None = resume_safe(None)
    """Number of processes (hosts) in the job; None reads JAX_NUM_PROCESSES or auto-detects."""
    process_id: int | None = resume_safe(None)
    """This process's index in [0, num_processes); None reads JAX_PROCESS_ID or auto-detects."""
    initialization_timeout_s: int = resume_safe(300)
    """Seconds to wait for every process to reach the coordinator."""

    def __post_init__(self) -> None:
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise ConfigError(f"distributed.num_processes must be >= 1, got {n}")
        if n is not None and i is not None and not 0 <= i < n:
            raise ConfigError(
                f"distributed.process_id={i} is outside [0, distributed.num_processes={n})"
            )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Decoder architecture."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts layers."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Kernel backends used by the MoE layers."""
    data: DataConfig = field(default_factory=DataConfig)
    """Input pipeline."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """Device mesh and logical-axis rules."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process (multi-host) start-up."""

    def __post_init__(self) -> None:
        # model and moe as model.family's section classes (config/families.py), also when built
        # in code from the base classes; an unregistered family keeps them as given (the model
        # build names it).
        sections = families.lookup(self.model.family)
        if sections is not None:
            family = self.model.family
            model = families.as_family_class(self.model, sections.model, "model", family)
            moe = families.as_family_class(self.moe, sections.moe, "moe", family)
            object.__setattr__(self, "model", model)
            object.__setattr__(self, "moe", moe)

    def replace(self, **sections: Any) -> Config:
        """A copy with the given sections replaced, e.g. `cfg.replace(train=train_cfg)`."""
        return dataclasses.replace(self, **sections)


def _positive(section: str, **values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"{section}.{name} must be positive, got {value}")
