"""One typed config tree for a pretraining run: YAML file + dotted command-line overrides.

    cfg = load_config("pretrain/configs/tiny_llama.yaml", ["parallel.tensor=2", "train.steps=10"])

Override values are parsed as YAML (`data.blend=[1.0,/data/x_text_document]`). Unknown keys, keys given twice,
values of the wrong type and config paths that are no YAML text file are rejected with one message naming the
key or path (the parsing is `pretrain/config_parse.py`). Model presets (`model.preset`) fill every model field
the file and the overrides leave unset.
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from model_providers import DEFAULT_FAMILY, FAMILIES
from pretrain.config_parse import ConfigError, build, parse_override, parse_yaml, set_dotted, yaml_error_line
from pretrain.performance import PerformanceConfig

__all__ = ["CONFIG_DIR", "Config", "ConfigError", "config_from_dict", "load_config", "parse_override",
           "resolve_config_path", "save_config"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MAX_CONFIG_BYTES = 1 << 20  # a config is a small YAML file; anything bigger is the wrong file


@dataclass
class ModelConfig:
    """Model shape and numerics. Field names follow Megatron-Core's `TransformerConfig` where one exists."""

    preset: str | None = None
    family: str = DEFAULT_FAMILY  # a family of model_providers/ (checked when the config is parsed)
    num_layers: int = 4
    hidden_size: int = 256
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    num_attention_heads: int = 8
    num_query_groups: int | None = None  # None: multi-head attention (= num_attention_heads)
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    seq_length: int = 256  # training sequence length
    max_position_embeddings: int | None = None  # the model's context length (None: seq_length)
    vocab_size: int | None = None  # None: taken from the tokenizer
    make_vocab_size_divisible_by: int = 128
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    gated_linear_unit: bool = True  # SwiGLU when activation is "silu"
    # quick_gelu: x·sigmoid(1.702x) (GPT-OSS); squared_relu: relu(x)² (Nemotron-H, with gated_linear_unit=false)
    activation: Literal["silu", "gelu", "quick_gelu", "squared_relu"] = "silu"
    # GLU (GPT-OSS's clamped SwiGLU, Megatron-Core's names): act(min(gate, c)) · (clamp(up, ±c) + offset).
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    # yarn: YaRN RoPE with model.rotary_scaling_factor, original_max_position_embeddings, beta_fast/slow, mscale*;
    # none: no position encoding (Nemotron-H: order comes from its Mamba layers; hybrid models only).
    position_embedding_type: Literal["rope", "learned_absolute", "yarn", "none"] = "rope"
    yarn_correction_range_round_to_int: bool = True  # YaRN's correction range rounded (GPT-OSS: false, "truncate")
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False  # Llama-3 ("llama3") RoPE frequency scaling
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    share_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False  # per-head norm of queries and keys (model.normalization, before RoPE)
    sliding_window: int | None = None  # attention window: a token sees itself and the sliding_window-1 before it
    # Which layers use the window (Megatron-Core's name): None all; N: every N-th layer full; a list: 1 windowed.
    window_attn_skip_freq: int | list[int] | None = None
    # Attention sinks (Megatron-Core's softmax_type): learnable = one logit per head added to the softmax (GPT-OSS).
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    apply_residual_connection_post_layernorm: bool = False
    # Recompute: None | "selective" | "full"; method "uniform" | "block" for full.
    recompute_granularity: Literal["selective", "full"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    # Fused SwiGLU / bias-GELU kernels (torch.compile'd): None = on GPU, off on CPU.
    bias_activation_fusion: bool | None = None
    # Selective recompute: which submodules (Megatron-Core's names); None: ["core_attn"] (Megatron's default).
    # moe (the whole MoE layer), moe_act (the experts' activation, grouped GEMM only), shared_experts: MoE models
    # only; mla_up_proj (MLA's up-projections and RoPE): multi-latent attention only (pretrain/rules/recompute.py).
    recompute_modules: list[Literal["core_attn", "mlp", "layernorm", "moe", "moe_act", "mla_up_proj",
                                    "shared_experts"]] | None = None
    # Transformer Engine / FP8 (GPU only; validated).
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    fp8: Literal["tensorwise", "delayed", "mxfp8", "blockwise"] | None = None
    fp8_param_gather: bool = False
    # Mixture of Experts (None: dense). Names follow Megatron-Core's TransformerConfig.
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # one expert's FFN size; None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    # False: softmax over the top-k logits (= softmax over all, renormalised over the top k: Mixtral,
    # Qwen3-MoE with norm_topk_prob); True: softmax over all experts, top-k probabilities not renormalised.
    moe_router_pre_softmax: bool = False
    moe_router_dtype: Literal["fp32", "fp64"] | None = "fp32"  # None: the activations' dtype
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    moe_grouped_gemm: bool | None = None  # None: Transformer Engine grouped GEMM with the TE spec
    # DeepSeek-V3 class (docs/moe.md): Multi-Latent Attention, DeepSeek routing, dense-first layers, Multi-Token
    # Prediction. Names follow Megatron-Core's MLATransformerConfig / TransformerConfig.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected directly (HF q_proj); else q_a_proj → norm → q_b_proj
    kv_lora_rank: int = 512  # the compressed KV width (HF kv_lora_rank)
    qk_head_dim: int = 128  # per-head query/key width without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 64  # per-head RoPE width, shared by all heads for keys (HF qk_rope_head_dim)
    v_head_dim: int = 128
    rope_type: Literal["rope", "yarn"] = "rope"  # MLA's RoPE; yarn: YaRN with the fields below
    rotary_scaling_factor: float = 1.0  # YaRN factor
    original_max_position_embeddings: int = 4096  # YaRN: the pre-extension context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    moe_layer_freq: int | list[int] = 1  # 1: every layer MoE; a list of 0 (dense) / 1 (MoE) per layer
    moe_shared_expert_intermediate_size: int | None = None  # shared experts' total FFN size (None: none)
    moe_router_num_groups: int | None = None  # group-limited routing: expert groups
    moe_router_group_topk: int | None = None  # ... and how many of them a token may use
    moe_router_topk_scaling_factor: float | None = None  # routing weights × this (HF routed_scaling_factor)
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias on the scores
    moe_router_bias_update_rate: float = 1e-3  # ... moved by ± this per step toward balanced load
    mtp_num_layers: int | None = None  # Multi-Token Prediction depth (None: off)
    mtp_loss_scaling_factor: float = 0.1  # MTP loss weight (divided over the MTP layers)
    # Megatron-Core's name for the FP8 recipe, model.fp8's value (e.g. blockwise): either key sets it, both must agree.
    fp8_recipe: Literal["tensorwise", "delayed", "mxfp8", "blockwise"] | None = None
    # ---- Hybrid Mamba models (Megatron-Core's MambaModel; family nemotron_h; docs/hybrid.md). Megatron-Core's names.
    # One symbol per layer (num_layers of them): M Mamba-2, * attention, - MLP, E MoE. None: a GPTModel (no Mamba).
    hybrid_layer_pattern: str | None = None
    mamba_state_dim: int = 128  # SSM state size per group (HF ssm_state_size)
    mamba_head_dim: int = 64
    mamba_num_heads: int | None = None  # None: 2 × hidden_size / mamba_head_dim (Megatron-Core's expand=2)
    mamba_num_groups: int = 8  # B/C groups (HF n_groups); the gated RMSNorm normalises per group
    mamba_conv_kernel: int = 4  # causal depthwise conv width (MambaMixer d_conv; HF conv_kernel): 2-4
    mamba_chunk_size: int = 128  # SSD scan chunk (MambaMixer chunk_size; HF chunk_size): a power of 2
    mamba_dt_min: float = 0.001  # initial time steps drawn log-uniformly in [dt_min, dt_max] (init only)
    mamba_dt_max: float = 0.1
    mamba_dt_init_floor: float = 1e-4  # ... and at least this
    moe_latent_size: int | None = None  # LatentMoE (Nemotron 3 Super): experts run at this width (h → latent → h)


@dataclass
class ParallelConfig:
    """Parallel layout. Data parallelism is what is left of the world size."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None  # None: not interleaved
    context: int = 1
    expert: int = 1  # expert parallel (MoE): experts split across this many ranks
    expert_tensor: int | None = None  # tensor parallel inside each expert; None: parallel.tensor
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False  # Transformer Engine userbuffers overlap (GPU only)
    # None: automatic (False on gloo, where batched p2p with PP=2 interleaving is silently wrong).
    batch_p2p_comm: bool | None = None
    # Uneven pipeline stages (Megatron-Core's names): decoder layers of the first / last stage (null: an even
    # share); the other stages split the rest evenly. E.g. DeepSeek-V3's 61 layers on PP8: 7, 6 (8 per middle stage).
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    # Flexible placement (pretrain/placement.py), Megatron-Core's own options: a pipeline_model_parallel_layout
    # string (one `|`-separated stage per virtual stage: E embedding, t decoder layer, m MTP layer, L loss; e.g.
    # "Et*4|(t*4|)*14tmL"), or the embedding / loss counted as one layer of the even split.
    pipeline_layout: str | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Context-parallel attention (Megatron's cp_comm_type, on GPU with Transformer Engine and on CPU alike):
    # p2p ring of K/V blocks, all_gather of K/V, a2a (Ulysses: heads <-> sequence), a2a+p2p (hierarchical).
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets (blends) or synthetic tokens."""

    mock: bool = False
    blend: list | None = None  # [weight, prefix, weight, prefix, ...] or [prefix, ...]
    train_blend: list | None = None  # per-split blends (instead of blend + split)
    valid_blend: list | None = None
    test_blend: list | None = None
    split: str = "969,30,1"
    tokenizer_type: str = "sentencepiece"
    tokenizer_model: str | None = None  # None: the embedded Mistral-7B SentencePiece model
    vocab_file: str | None = None
    merge_file: str | None = None
    num_workers: int = 0
    cache_dir: str | None = None  # None: run.dir/data_cache
    # Document boundaries inside packed samples (Megatron-Core's GPTDatasetConfig fields).
    eod_mask_loss: bool = False  # no loss on predicting across a document boundary
    reset_position_ids: bool = False  # positions restart at 0 after each end-of-document token
    reset_attention_mask: bool = False  # tokens attend only within their own document
    # True: train on datasets whose PREFIX.meta.json names another tokenizer than the run's (checked otherwise).
    allow_tokenizer_mismatch: bool = False


@dataclass
class MuonConfig:
    """Muon (optimizer.name=muon): Megatron-Core's `muon_*` OptimizerConfig fields, same names and defaults
    (docs/training.md "Muon"); QK-clip is Megatron-Core's TransformerConfig `qk_clip*`."""

    momentum: float = 0.95
    nesterov: bool = False
    num_ns_steps: int = 5  # Newton-Schulz iterations
    coefficient_type: Literal["quintic", "simple", "polar_express", "cans", "aol"] = "quintic"  # 0.16.1: quintic
    scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    extra_scale_factor: float = 1.0  # 0.2 with scale_mode=spectral: Moonlight's AdamW-RMS-matched update
    split_qkv: bool = True  # orthogonalise Q, K and V of the fused QKV weight separately
    tp_mode: Literal["blockwise", "duplicated", "distributed"] = "blockwise"
    fp32_matmul_prec: Literal["highest", "high", "medium"] = "medium"
    layer_wise: bool = False  # LayerWiseDistributedOptimizer: each DP rank updates whole matrices, then all-gather
    qk_clip: bool = False  # MuonClip (Kimi K2): rescale W_q, W_k of heads whose max logit exceeds the threshold
    qk_clip_threshold: float = 100.0
    qk_clip_alpha: float = 0.5


@dataclass
class OptimizerConfig:
    """Adam(W) or Muon, and the learning-rate schedule (Megatron-Core `OptimizerParamScheduler`)."""

    name: Literal["adamw", "muon"] = "adamw"  # muon: matrices by Muon, the rest by AdamW (Megatron-Core's split)
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = False  # Megatron distributed optimizer (ZeRO-1 over data parallel)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = True  # False: bf16 grad buffers (half the gradient memory)
    warmup_steps: int = 0
    decay_style: Literal["cosine", "linear", "constant", "WSD", "inverse-square-root"] = "cosine"
    decay_steps: int | None = None  # None: train.steps
    wsd_decay_steps: int | None = None
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    fsdp: bool = False  # Megatron-FSDP: parameters, gradients and optimizer state sharded over data parallel
    # What Megatron-FSDP shards over DP (Megatron-Core's data_parallel_sharding_strategy): optim_grads_params
    # (ZeRO-3, the default), optim_grads (ZeRO-2), optim (ZeRO-1). Setting it implies optimizer.fsdp=true.
    fsdp_sharding: Literal["optim_grads_params", "optim_grads", "optim"] | None = None
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class TrainConfig:
    """Batch sizes, length, seeding and numerics of the run."""

    micro_batch_size: int = 1
    global_batch_size: int = 8
    steps: int = 100
    seed: int = 1234
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    eval_interval: int | None = None
    eval_iters: int = 2
    exit_duration_in_mins: float | None = None  # save and stop after this wall-clock duration
    nan_policy: Literal["stop", "skip"] = "stop"  # what a NaN/Inf loss or grad norm does
    exit_signal_handler: bool = True  # SIGTERM/SIGUSR1: save and exit 0
    skip_steps: list = field(default_factory=list)  # steps consumed, not trained: [5, "10-12"] (docs/training.md)


@dataclass
class CheckpointConfig:
    """Megatron-Core distributed checkpoints (`torch_dist`)."""

    interval: int | None = None  # None: only at the end (and on signals)
    dir: str | None = None  # None: run.dir/checkpoints
    keep_last: int | None = None  # None: keep all
    async_save: bool = False
    pretrained: str | None = None  # weights-only start when run.dir has no checkpoint yet
    save_optimizer: bool = True
    load_optimizer: bool = True
    save_at_end: bool = True


@dataclass
class WandbConfig:
    """Weights & Biases: the same scalars as TensorBoard. Off while `project` is null."""

    project: str | None = None
    entity: str | None = None
    name: str | None = None  # None: run.name, else the run directory's name
    mode: Literal["online", "offline", "disabled"] = "online"


@dataclass
class ProfileConfig:
    """A profiler window: steps start_step..end_step (inclusive, 1-based as in metrics.jsonl)."""

    start_step: int | None = None  # None: no profiling
    end_step: int | None = None
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks that write a trace


@dataclass
class LoggingConfig:
    """Where scalars go."""

    log_interval: int = 1
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    timing_interval: int | None = None  # every N steps: each rank's compute/wait split, slowest ranks named
    straggler_threshold: float = 0.2  # ... and the ranks whose compute is more than this fraction over the median


@dataclass
class RunConfig:
    """The run's home: metrics, TensorBoard, checkpoints and caches live under `dir`."""

    dir: str = "runs/default"
    name: str | None = None
    # Run on a Python/megatron-core/Transformer Engine/torch combination outside the supported matrix
    # (docs/compatibility.md): validation then warns instead of refusing.
    allow_untested_versions: bool = False


# Fault handling (pretrain/resilience/, docs/training.md "Faults")
# The environment variable that allows `testing.*` keys (fault injection): set by the test suite only.
TESTING_ENV = "PRETRAIN_TESTING"


@dataclass
class RerunConfig:
    """Result validation every step by Megatron-Core's `RerunStateMachine` (docs/training.md, "Faults")."""

    mode: Literal["disabled", "validate_results", "report_stats"] = "validate_results"
    spike_factor: float | None = 10.0  # a loss >= factor x the maximum of the first spike_window steps is a spike
    spike_window: int = 100  # steps whose loss sets that maximum (Megatron's num_samples)
    on_transient: Literal["continue", "stop"] = "continue"  # a result the re-run does not reproduce


@dataclass
class HangConfig:
    """The per-rank hang watchdog and the process groups' timeout."""

    enabled: bool = True
    factor: float = 10.0  # a step may take factor x the median step time ...
    floor_s: float = 600.0  # ... and at least this long
    long_s: float = 1800.0  # the first step, checkpoint saves and evaluation
    process_group_timeout_s: float | None = None  # the default process group's timeout; None: 10 minutes


@dataclass
class TestingConfig:
    """Faults injected on purpose (refused unless PRETRAIN_TESTING=1: the test suite). Steps are 1-based."""

    nan_step: int | None = None  # the loss is NaN at this step on rank nan_rank
    nan_rank: int = 0
    nan_times: Literal["once", "always"] = "once"  # once: transient (the re-run is clean); always: persistent
    spike_step: int | None = None  # the loss x spike_scale at this step on rank spike_rank (once)
    spike_rank: int = 0
    spike_scale: float = 1000.0
    spike_times: Literal["once", "always"] = "once"
    hang_step: int | None = None  # rank hang_rank sleeps forever in this step (before its first collective)
    hang_rank: int = 0
    hang_how: Literal["sleep", "sigstop"] = "sleep"  # sigstop: the rank stops itself (SIGSTOP)
    slow_rank: int | None = None  # this rank sleeps slow_s in every step's compute (a straggler)
    slow_s: float = 0.0


@dataclass
class Config:
    """The whole run, passed explicitly to every part of the program."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)  # pretrain/performance.py
    rerun: RerunConfig = field(default_factory=RerunConfig)  # result validation (pretrain/resilience/)
    hang: HangConfig = field(default_factory=HangConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)  # fault injection, tests only

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def resolve_config_path(path: str | Path) -> Path:
    """A config path as given, or a bare name (`tiny_llama`) looked up in pretrain/configs/."""
    p = Path(path)
    if p.exists():
        return p
    for candidate in (CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.yaml"):
        if candidate.exists():
            return candidate
    raise ConfigError(f"config file '{path}' not found (shipped configs: {_shipped_names()})")


def read_config_text(p: Path) -> str:
    """The text of a config file: a regular file of at most `MAX_CONFIG_BYTES`, UTF-8 without NUL bytes (a
    directory, a device such as /dev/zero, a pipe or a binary file is refused with one line)."""
    try:
        st = p.stat()
    except OSError as exc:
        raise ConfigError(f"config file '{p}' cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"config file '{p}' is a directory; give a YAML file (shipped configs: {_shipped_names()})")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"config file '{p}' is not a regular file (a device, pipe or socket); give a YAML file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file '{p}' is {st.st_size:,} bytes; a config is a YAML file of at most "
                          f"{MAX_CONFIG_BYTES:,} bytes (is this the right file?)")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file '{p}' cannot be read ({exc.strerror or exc})") from None
    if b"\x00" in data:
        raise ConfigError(f"config file '{p}' is a binary file (it holds NUL bytes), not YAML text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start})") from None


def _shipped_names() -> str:
    return ", ".join(sorted(f.stem for f in CONFIG_DIR.glob("*.yaml")))


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Build a `Config` from a nested dict, applying the model preset under explicit model keys."""
    tree = dict(tree)
    model = dict(tree.get("model") or {})
    preset = model.get("preset")
    if preset is not None:
        from model_providers import get_preset

        try:
            base = get_preset(preset)
        except KeyError as exc:
            raise ConfigError(str(exc.args[0])) from None
        model = {**base, **model}
    tree["model"] = model
    cfg = build(Config, tree, "")
    m = cfg.model
    if m.fp8_recipe is not None and m.fp8 is not None and m.fp8_recipe != m.fp8:
        raise ConfigError(f"model.fp8_recipe={m.fp8_recipe} and model.fp8={m.fp8} disagree: they name the same "
                          "FP8 recipe (set one of them)")
    m.fp8 = m.fp8_recipe = m.fp8 or m.fp8_recipe  # one value under both names, as config.yaml records it
    if cfg.model.family not in FAMILIES:
        raise ConfigError(f"model.family={cfg.model.family!r} is not one of {', '.join(FAMILIES)}")
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML (or start from defaults when `path` is None) and apply dotted overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_path(path)
        text = read_config_text(p)
        try:
            loaded = parse_yaml(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {yaml_error_line(exc)}") from None
        except ConfigError as exc:  # a key given twice
            raise ConfigError(f"{p}: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        tree = loaded
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    return config_from_dict(tree)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (what a run actually used)."""
    Path(path).write_text(cfg.to_yaml())
