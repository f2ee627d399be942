"""Run rules: optimizer and schedule, run/checkpoint settings, data sources and the pretrained checkpoint."""

from __future__ import annotations

from pretrain.config import CheckpointConfig, DataConfig, ModelConfig, OptimizerConfig, TrainConfig
from pretrain.problems import Report


def optimizer_rules(r: Report, *, optimizer: OptimizerConfig, train: TrainConfig) -> None:
    """Optimizer and schedule."""
    o, t = optimizer, train
    if o.overlap_param_gather and not (o.distributed or o.fsdp):  # Megatron-FSDP wraps the distributed optimizer
        r.error(("optimizer.overlap_param_gather", "optimizer.distributed"),
                "optimizer.overlap_param_gather needs the distributed optimizer", "set optimizer.distributed=true")
    if o.lr == 0:
        r.notes.append("optimizer.lr=0: the weights never change (an evaluation-only run)")
    if o.min_lr > o.lr:
        r.error(("optimizer.min_lr", "optimizer.lr"), f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}",
                "set min_lr <= lr")
    if o.decay_style == "WSD" and o.wsd_decay_steps is None:  # 0: the range rule's
        r.error(("optimizer.decay_style", "optimizer.wsd_decay_steps"), "WSD decay needs optimizer.wsd_decay_steps",
                "set optimizer.wsd_decay_steps (e.g. 10% of train.steps)")
    if 0 <= o.warmup_steps >= (o.decay_steps or t.steps):
        r.notes.append(f"optimizer.warmup_steps={o.warmup_steps} >= decay steps {o.decay_steps or t.steps}: "
                       "the learning rate never reaches its peak")


def run_rules(r: Report, *, train: TrainConfig) -> None:
    """Training run: the batch-size ramp (evaluation, time limit and checkpoint counts: their declared ranges)."""
    ramp_rules(r, train)


def ramp_rules(r: Report, t: TrainConfig) -> None:
    """train.rampup_batch_size (train section `t`) as Megatron-Core's calculator takes it (whether every batch it
    passes through divides into the stage's micro batch × DP: `pretrain.stages.plan`, which walks the ramp)."""
    ramp = t.rampup_batch_size
    if ramp is None:
        return
    key = "train.rampup_batch_size"
    if len(ramp) != 3 or min(ramp) < 1:
        r.error(key, f"{key}={ramp} must be three positive integers [start, increment, ramp_samples]",
                f"e.g. {key}=[{max(1, t.global_batch_size // 4)}, {max(1, t.global_batch_size // 4)}, 100000], or "
                "null for no ramp")
        return
    start, increment, _ = ramp
    if start >= t.global_batch_size:
        r.error((key, "train.global_batch_size"), f"the ramp starts at {start} samples, not below "
                f"train.global_batch_size={t.global_batch_size}", "start the ramp below the global batch size, or "
                f"set {key}=null")
    elif (t.global_batch_size - start) % increment:
        r.error((key, "train.global_batch_size"), f"the ramp from {start} to train.global_batch_size="
                f"{t.global_batch_size} samples is not a whole number of increments of {increment}",
                f"an increment that divides {t.global_batch_size - start}")


def ramp_fits(r: Report, t: TrainConfig, batch_sizes: tuple[int, ...], steps: tuple[int, int], dp: int | None) -> None:
    """Each global batch the ramp takes in a stage (`batch_sizes`, in its `steps`: first and last) divides into its
    micro batch × `dp` (Megatron's consistency check, before the step that would fail it; `t`: the stage's train
    section; the stages walk the ramp: `pretrain.stages.plan`)."""
    if t.rampup_batch_size is None or dp is None:
        return
    unit = t.micro_batch_size * dp
    bad = [b for b in batch_sizes if b % unit]
    if bad:
        r.error("train.rampup_batch_size", f"the ramp's global batch of {bad[0]} samples (of "
                f"{', '.join(map(str, batch_sizes))} in steps {steps[0]}-{steps[1]}) "
                f"does not divide into micro batch {t.micro_batch_size} × DP {dp}",
                f"a ramp whose start and increment are multiples of {unit}")


def data_rules(r: Report, *, model: ModelConfig, data: DataConfig, train: TrainConfig, checkpoint: CheckpointConfig,
               tokenizer=None, data_plan=None) -> None:
    """Data sources, tokenizer and dataset files (pretrain/data/check.py), and the pretrained checkpoint.
    `tokenizer`, `data_plan`: the run plan's `TokenizerPlan` and `DataPlan`."""
    from pretrain.data.check import check_data_config, check_data_files

    check_data_config(data_plan, tokenizer, train, r)
    # O(1) per file where the metadata cannot stand for the index: the trainer's one-rank check reads it in full
    check_data_files(data_plan, tokenizer, model, r, header_only=True)
    _check_pretrained(checkpoint, r)
    _check_cache_dir(data, r)


def data_config_rules(r: Report, *, data: DataConfig, train: TrainConfig, checkpoint: CheckpointConfig,
                      tokenizer=None, data_plan=None) -> None:
    """`data_rules` without opening a dataset file (those are checked on one rank: `pretrain.data.datasets`)."""
    from pretrain.data.check import check_data_config

    check_data_config(data_plan, tokenizer, train, r)
    _check_pretrained(checkpoint, r)
    _check_cache_dir(data, r)


def _check_cache_dir(d: DataConfig, r: Report) -> None:
    """data.cache_dir, when given, is a directory or does not exist yet (Megatron-Core writes its caches in it)."""
    import os

    path = d.cache_dir
    if path and os.path.lexists(path) and not os.path.isdir(path):
        r.error("data.cache_dir", f"data.cache_dir={path} exists and is not a directory",
                "give a directory (created if missing) for Megatron's dataset index caches, or null for "
                "run.dir/data_cache")


def _check_pretrained(c: CheckpointConfig, r: Report) -> None:
    """checkpoint.pretrained names a complete checkpoint (a run dir, a checkpoints dir or an iteration dir)."""
    if not c.pretrained:
        return
    from pretrain.checkpoint.format import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(c.pretrained)
    except (CheckpointError, OSError) as e:
        r.error("checkpoint.pretrained", f"checkpoint.pretrained: {e}",
                "give a run directory, its checkpoints/ directory or an iter_NNNNNNN directory, or remove the key")


