"""One typed config tree for a pretraining run: YAML file + dotted command-line overrides.

    cfg = load_config("pretrain/configs/tiny_llama.yaml", ["parallel.tensor=2", "train.steps=10"])

Override values are parsed as YAML (`data.blend=[1.0,/data/x_text_document]`). Unknown keys, keys given twice,
values of the wrong type and config paths that are no YAML text file are rejected with one message naming the
key or path (the parsing is `pretrain/config_parse.py`). Model presets (`model.preset`) fill every model field
the file and the overrides leave unset.

Each field declares its facts where it is declared (`knob(default, mcore=..., resume=..., range=...)`,
`model_providers/core/knobs.py`): the Megatron-Core attribute it feeds, its rule on resume (a section's `RESUME`
for the fields that name none), the values `validate` accepts. The model section is `pretrain/sections/model.py`.
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from model_providers import FAMILIES
from model_providers.core.knobs import (
    CHANGE,
    DATASET,
    DDP,
    MATCH,
    NEXT_STEP,
    OPT,
    QK_CLIP,
    REPLACED,
    RESHARD,
    UNUSED,
    Resume,
    knob,
)
from pretrain.config_parse import ConfigError, build, parse_override, parse_yaml, set_dotted, yaml_error_line
from pretrain.performance import PerformanceConfig
from pretrain.sections.model import ModelConfig

__all__ = ["CONFIG_DIR", "Config", "ConfigError", "ModelConfig", "config_from_dict", "load_config", "parse_override",
           "resolve_config_path", "save_config"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MAX_CONFIG_BYTES = 1 << 20  # a config is a small YAML file; anything bigger is the wrong file
SCHEDULE = Resume(CHANGE, "the LR schedule is re-derived from this config at the resumed step")
TOKENIZER = Resume(MATCH, "the tokenizer, compared by identity (kind and SHA-256 of its files), not by path")
NEW_DATA = Resume(CHANGE, "training reads the new data from consumed_samples on (a new stage: from its own first "
                            "sample)")


@dataclass
class ParallelConfig:
    """Parallel layout. Data parallelism is what is left of the world size. (The sizes reach Megatron-Core through
    `pretrain.layout.Layout`.)"""

    RESUME = RESHARD

    tensor: int = knob(1, range=">= 1")
    pipeline: int = knob(1, range=">= 1")
    virtual_pipeline: int | None = knob(None, range=">= 2", fix="set {key} to 2 or more, or null for no interleaving")
    context: int = knob(1, range=">= 1")
    expert: int = knob(1, range=">= 1")  # expert parallel (MoE): experts split across this many ranks
    expert_tensor: int | None = knob(None, range=">= 1")  # tensor parallel inside each expert; None: parallel.tensor
    sequence_parallel: bool = False
    tp_comm_overlap: bool = knob(False, resume=NEXT_STEP)  # Transformer Engine userbuffers overlap (GPU only)
    # None: automatic (False on gloo, where batched p2p with PP=2 interleaving is silently wrong).
    batch_p2p_comm: bool | None = knob(None, resume=NEXT_STEP)
    # Uneven pipeline stages (Megatron-Core's names): decoder layers of the first / last stage (null: an even
    # share); the other stages split the rest evenly. E.g. DeepSeek-V3's 61 layers on PP8: 7, 6 (8 per middle stage).
    num_layers_in_first_pipeline_stage: int | None = knob(None, range=">= 1")
    num_layers_in_last_pipeline_stage: int | None = knob(None, range=">= 1")
    # Flexible placement (pretrain/placement.py), Megatron-Core's own options: a pipeline_model_parallel_layout
    # string (one `|`-separated stage per virtual stage: E embedding, t decoder layer, m MTP layer, L loss; e.g.
    # "Et*4|(t*4|)*14tmL"), or the embedding / loss counted as one layer of the even split.
    pipeline_layout: str | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Context-parallel attention (Megatron's cp_comm_type, on GPU with Transformer Engine and on CPU alike):
    # p2p ring of K/V blocks, all_gather of K/V, a2a (Ulysses: heads <-> sequence), a2a+p2p (hierarchical).
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = knob("p2p", resume=NEXT_STEP)


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets (blends) or synthetic tokens."""

    RESUME = NEXT_STEP

    mock: bool = knob(False, resume=NEW_DATA)
    blend: list | None = knob(None, resume=NEW_DATA)  # [weight, prefix, weight, prefix, ...] or [prefix, ...]
    train_blend: list | None = knob(None, resume=NEW_DATA)  # per-split blends (instead of blend + split)
    valid_blend: list | None = knob(None, resume=NEW_DATA)
    test_blend: list | None = knob(None, resume=NEW_DATA)
    split: str = knob("969,30,1", resume=NEW_DATA)
    tokenizer_type: str = knob("sentencepiece", resume=TOKENIZER)
    tokenizer_model: str | None = knob(None, resume=TOKENIZER)  # None: the embedded Mistral-7B SentencePiece model
    vocab_file: str | None = knob(None, resume=TOKENIZER)
    merge_file: str | None = knob(None, resume=TOKENIZER)
    num_workers: int = knob(0, range="[0, 1024]")
    cache_dir: str | None = None  # None: run.dir/data_cache
    # Document boundaries inside packed samples (Megatron-Core's GPTDatasetConfig fields).
    eod_mask_loss: bool = knob(False, mcore=DATASET)  # no loss on predicting across a document boundary
    reset_position_ids: bool = knob(False, mcore=DATASET)  # positions restart at 0 after each end-of-document token
    reset_attention_mask: bool = knob(False, mcore=DATASET)  # tokens attend only within their own document
    # True: train on datasets whose PREFIX.meta.json names another tokenizer than the run's (checked otherwise).
    allow_tokenizer_mismatch: bool = False


@dataclass
class MuonConfig:
    """Muon (optimizer.name=muon): Megatron-Core's `muon_*` OptimizerConfig fields, same names and defaults
    (docs/training.md "Muon"; `pretrain/compat/muon.py` renames them for releases that name them otherwise); QK-clip
    is Megatron-Core's TransformerConfig `qk_clip*`."""

    RESUME = REPLACED

    momentum: float = knob(0.95, mcore=OPT.named("muon_momentum"), range="[0, 1)")
    nesterov: bool = knob(False, mcore=OPT.named("muon_nesterov"))
    # Newton-Schulz iterations (each a few matrix products per weight per step)
    num_ns_steps: int = knob(5, mcore=OPT.named("muon_num_ns_steps"), range="[1, 100]")
    coefficient_type: Literal["quintic", "simple", "polar_express", "cans", "aol"] = knob(  # 0.16.1: quintic
        "quintic", mcore=OPT.named("muon_coefficient_type"))
    scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = knob(
        "spectral", mcore=OPT.named("muon_scale_mode"))
    # 0.2 with scale_mode=spectral: Moonlight's AdamW-RMS-matched update
    extra_scale_factor: float = knob(1.0, mcore=OPT.named("muon_extra_scale_factor"), range="> 0")
    # orthogonalise Q, K and V of the fused QKV weight separately
    split_qkv: bool = knob(True, mcore=OPT.named("muon_split_qkv"))
    tp_mode: Literal["blockwise", "duplicated", "distributed"] = knob("blockwise", mcore=OPT.named("muon_tp_mode"))
    fp32_matmul_prec: Literal["highest", "high", "medium"] = knob("medium", mcore=OPT.named("muon_fp32_matmul_prec"))
    # LayerWiseDistributedOptimizer: each DP rank updates whole matrices, then all-gather
    layer_wise: bool = knob(False, resume=Resume(CHANGE, "Muon's momentum is loaded into this run's optimizer (whole "
                                                          "matrices either way)"))
    # MuonClip (Kimi K2): rescale W_q, W_k of heads whose max logit exceeds the threshold
    qk_clip: bool = knob(False, mcore=QK_CLIP)
    qk_clip_threshold: float = knob(100.0, mcore=QK_CLIP, range="> 0")
    qk_clip_alpha: float = knob(0.5, mcore=QK_CLIP, range="[0, 1]")


@dataclass
class OptimizerConfig:
    """Adam(W) or Muon, and the learning-rate schedule (Megatron-Core `OptimizerParamScheduler`)."""

    RESUME = NEXT_STEP

    # muon: matrices by Muon, the rest by AdamW (Megatron-Core's split)
    name: Literal["adamw", "muon"] = knob("adamw", resume=Resume(
        CHANGE, "only with checkpoint.load_optimizer=false: the new optimizer starts fresh from the checkpoint's "
                "weights (AdamW's moments are not Muon's momentum); refused otherwise"))
    lr: float = knob(3e-4, mcore=OPT, resume=SCHEDULE, range=">= 0")
    min_lr: float = knob(3e-5, mcore=OPT, resume=SCHEDULE, range=">= 0")
    weight_decay: float = knob(0.1, mcore=OPT, resume=REPLACED, range=">= 0")
    adam_beta1: float = knob(0.9, mcore=OPT, resume=REPLACED, range="[0, 1)")
    adam_beta2: float = knob(0.95, mcore=OPT, resume=REPLACED, range="[0, 1)")
    adam_eps: float = knob(1e-8, mcore=OPT, resume=REPLACED, range="> 0")
    clip_grad: float = knob(1.0, mcore=OPT, resume=REPLACED, range=">= 0", why="0: no clipping")
    # Megatron distributed optimizer (ZeRO-1 over data parallel)
    distributed: bool = knob(False, resume=Resume(CHANGE, "the optimizer state is converted to this run's optimizer"))
    overlap_grad_reduce: bool = knob(False, mcore=DDP)
    overlap_param_gather: bool = knob(False, mcore=DDP)
    grad_reduce_in_fp32: bool = knob(True, mcore=DDP)  # False: bf16 grad buffers (half the gradient memory)
    warmup_steps: int = knob(0, resume=SCHEDULE, range=">= 0")
    decay_style: Literal["cosine", "linear", "constant", "WSD", "inverse-square-root"] = knob(
        "cosine", resume=SCHEDULE)
    decay_steps: int | None = knob(None, resume=SCHEDULE, range=">= 1")  # None: train.steps
    wsd_decay_steps: int | None = knob(None, resume=SCHEDULE, range=">= 1")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = knob("linear", resume=SCHEDULE)
    # Megatron-FSDP: parameters, gradients and optimizer state sharded over data parallel
    fsdp: bool = knob(False, resume=Resume(CHANGE, "the checkpoint is loaded across formats (torch_dist ↔ "
                                                   "fsdp_dtensor, pretrain/checkpoint/cross_format.py) and saved in "
                                                   "this run's from then on"))
    # What Megatron-FSDP shards over DP (Megatron-Core's data_parallel_sharding_strategy): optim_grads_params
    # (ZeRO-3, the default), optim_grads (ZeRO-2), optim (ZeRO-1). Setting it implies optimizer.fsdp=true.
    fsdp_sharding: Literal["optim_grads_params", "optim_grads", "optim"] | None = knob(None, resume=Resume(
        CHANGE, "fsdp_dtensor holds the same global tensors for every strategy: the state is resharded to the new one"))
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class TrainConfig:
    """Batch sizes, length, seeding and numerics of the run."""

    RESUME = NEXT_STEP

    micro_batch_size: int = knob(1, range=">= 1", resume=Resume(CHANGE, "the same global batch in other "
                                                                         "microbatches"))
    global_batch_size: int = knob(8, range=">= 1", resume=Resume(
        CHANGE, "consumed_samples continues: the next step reads the samples after it"))
    steps: int = knob(100, range=">= 1", resume=Resume(
        CHANGE, "the run ends there; with optimizer.decay_steps null the LR decay is re-derived over it"))
    seed: int = knob(1234, range="[0, 4294967295]", why="numpy's seed range, which Megatron-Core's datasets use",
                     resume=Resume(CHANGE, "the data order from consumed_samples on and, after a reshard, the RNG"))
    # auto: fp32 on CPU, bf16 on GPU
    precision: Literal["auto", "bf16", "fp16", "fp32"] = knob("auto", resume=Resume(
        MATCH, "16-bit and fp32 runs keep different optimizer state"))
    eval_interval: int | None = knob(None, range=">= 1")
    eval_iters: int = knob(2, range=">= 1")
    exit_duration_in_mins: float | None = knob(None, range="> 0")  # save and stop after this wall-clock duration
    nan_policy: Literal["stop", "skip"] = "stop"  # what a NaN/Inf loss or grad norm does
    exit_signal_handler: bool = True  # SIGTERM/SIGUSR1: save and exit 0
    # steps consumed, not trained: [5, "10-12"] (docs/training.md)
    skip_steps: list = knob(default_factory=list, resume=Resume(CHANGE, "the listed steps still ahead are consumed, "
                                                                        "not trained"))
    # [start, increment, ramp_samples]: Megatron-Core's batch-size ramp-up (docs/training.md "Batch-size ramp-up").
    rampup_batch_size: list[int] | None = knob(None, resume=Resume(
        CHANGE, "the batch size at consumed_samples follows the new ramp"))


@dataclass
class CheckpointConfig:
    """Megatron-Core distributed checkpoints (`torch_dist`)."""

    RESUME = NEXT_STEP

    interval: int | None = knob(None, range=">= 1")  # None: only at the end (and on signals)
    dir: str | None = None  # None: run.dir/checkpoints
    keep_last: int | None = knob(None, range=">= 1")  # None: keep all
    async_save: bool = False
    # weights-only start when run.dir has no checkpoint yet
    pretrained: str | None = knob(None, resume=Resume(UNUSED, "the run resumes from its own checkpoint"))
    save_optimizer: bool = True
    load_optimizer: bool = True
    save_at_end: bool = True
    allow_dropped_weights: bool = False  # load a checkpoint with tensors this model has no place for (recorded)


@dataclass
class WandbConfig:
    """Weights & Biases: the same scalars as TensorBoard. Off while `project` is null."""

    RESUME = NEXT_STEP

    project: str | None = None
    entity: str | None = None
    name: str | None = None  # None: run.name, else the run directory's name
    mode: Literal["online", "offline", "disabled"] = "online"


@dataclass
class ProfileConfig:
    """A profiler window: steps start_step..end_step (inclusive, 1-based as in metrics.jsonl)."""

    RESUME = NEXT_STEP

    start_step: int | None = knob(None, range=">= 1")  # None: no profiling
    end_step: int | None = knob(None, range=">= 1")
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks that write a trace
    # record tensor allocations in the trace and print the window's peak (torch.profiler's profile_memory)
    memory: bool = False


@dataclass
class LoggingConfig:
    """Where scalars go."""

    RESUME = NEXT_STEP

    log_interval: int = knob(1, range=">= 1")
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # every N steps: each rank's compute/wait split, slowest ranks named
    timing_interval: int | None = knob(None, range=">= 1")
    # ... and the ranks whose compute is more than this fraction over the median
    straggler_threshold: float = knob(0.2, range="> 0")


@dataclass
class RunConfig:
    """The run's home: metrics, TensorBoard, checkpoints and caches live under `dir`."""

    RESUME = NEXT_STEP

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

    RESUME = Resume(CHANGE, "from the resumed step (the spike maximum comes from the checkpoint)")

    mode: Literal["disabled", "validate_results", "report_stats"] = "validate_results"
    # a loss >= factor x the maximum of the first spike_window steps is a spike
    spike_factor: float | None = knob(10.0, range="> 1")
    spike_window: int = knob(100, range=">= 1")  # steps whose loss sets that maximum (Megatron's num_samples)
    on_transient: Literal["continue", "stop"] = "continue"  # a result the re-run does not reproduce


@dataclass
class HangConfig:
    """The per-rank hang watchdog and the process groups' timeout."""

    RESUME = NEXT_STEP

    enabled: bool = True
    factor: float = knob(10.0, range="> 1", why="a step may take factor x the median")  # ... step time
    floor_s: float = knob(600.0, range="> 0")  # ... and at least this long
    long_s: float = knob(1800.0, range="> 0")  # the first step, checkpoint saves and evaluation
    # the default process group's timeout; None: 10 minutes
    process_group_timeout_s: float | None = knob(None, range="> 0")


@dataclass
class TestingConfig:
    """Faults injected on purpose (refused unless PRETRAIN_TESTING=1: the test suite). Steps are 1-based."""

    RESUME = Resume(CHANGE, "from the resumed step (injected faults: tests only)")

    nan_step: int | None = knob(None, range=">= 1")  # the loss is NaN at this step on rank nan_rank
    nan_rank: int = knob(0, range=">= 0")
    nan_times: Literal["once", "always"] = "once"  # once: transient (the re-run is clean); always: persistent
    spike_step: int | None = knob(None, range=">= 1")  # the loss x spike_scale at this step on rank spike_rank (once)
    spike_rank: int = knob(0, range=">= 0")
    spike_scale: float = knob(1000.0, range="finite")
    spike_times: Literal["once", "always"] = "once"
    # rank hang_rank sleeps forever in this step (before its first collective)
    hang_step: int | None = knob(None, range=">= 1")
    hang_rank: int = knob(0, range=">= 0")
    hang_how: Literal["sleep", "sigstop"] = "sleep"  # sigstop: the rank stops itself (SIGSTOP)
    slow_rank: int | None = knob(None, range=">= 0")  # this rank sleeps slow_s in every step's compute (a straggler)
    slow_s: float = knob(0.0, range=">= 0")


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
    # The run's stages, in order: [{name, steps | tokens, set: {dotted.key: value}, keep}] (pretrain/stages/,
    # docs/training.md "Stages"); null: one stage, the config itself.
    stages: list | None = knob(None, resume=Resume(
        CHANGE, "the run continues in the stage its step falls in (a stage that has started keeps its start: "
                "pretrain/stages/)"))

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
    train = tree.get("train") or {}
    if tree.get("stages") and isinstance(train, dict) and "steps" not in train:  # the length: the stages' sum
        tree["train"] = {**train, "steps": 0}
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
