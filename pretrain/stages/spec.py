"""The `stages:` list parsed, each stage's config resolved and its length known, from the config alone.

    stages:
      - {name: pretrain, tokens: 1.5e13}
      - {name: anneal, steps: 2000, set: {data.blend: [1.0, /data/hq_text_document]}}
      - {name: long, steps: 1000, keep: tokens, set: {model.seq_length: 32768, model.rope_scaling: true}}

A stage's config is the config before it with the stage's `set` applied (the dotted keys of command-line
overrides; the first stage's: the file and the command line), and `train.steps` the run's length, the sum of the
stages: a plain config of its own (`stages` null). A stage may not set what cannot change on resume (the resume
contract's "must match" keys: the model's shape, tokenizer, vocabulary, precision), nor the run's frame (its
length, run.dir, checkpoint.dir, the model preset). A stage that changes model.seq_length says whether the batch
keeps its tokens or its samples (`keep`), unless it sets train.global_batch_size itself.

`derive(cfg)` never raises for a bad stage: every problem is returned, naming its stage, and the stages after a
broken one are resolved from the config before it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from dataclasses import dataclass, field

from pretrain.config import Config, ConfigError, config_from_dict
from pretrain.config_parse import set_dotted
from pretrain.problems import Problem, Report
from pretrain.stages.samples import StageSamples, TokensNotExact, walk

STAGE_FIELDS = ("name", "steps", "tokens", "set", "keep")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # it names a checkpoint (stage_NAME) and metrics lines
# The run's frame: one length, one run directory, one checkpoint directory, one model.
FRAME = {
    "train.steps": "a stage's length is its own steps or tokens; the run's is their sum",
    "run.dir": "one run directory holds every stage",
    "checkpoint.dir": "one checkpoint directory holds every stage's checkpoints",
    "model.preset": "a preset sets the model's shape",
    "stages": "stages do not nest",
}


@dataclass(frozen=True)
class Stage:
    """One stage: its place in the run (steps `start_step` + 1 … `end_step`), its resolved config and what it set."""

    index: int
    name: str
    start_step: int
    steps: int
    first_sample: int  # the samples consumed before it (Megatron's calculator walked over the stages before)
    samples: int
    tokens: int
    batch_sizes: tuple[int, ...]
    cfg: Config
    sets: dict = field(default_factory=dict)  # dotted key -> the value it set (train.global_batch_size by `keep`)

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


@dataclass(frozen=True)
class StagedConfig:
    """The run's stages (one unnamed stage for a config without `stages`), its length and the problems found."""

    stages: tuple[Stage, ...]
    total_steps: int
    problems: tuple[Problem, ...] = ()
    staged: bool = True

    def at(self, step: int) -> Stage:
        """The stage step `step` + 1 runs in (the last one once the run is done)."""
        for stage in self.stages:
            if step < stage.end_step:
                return stage
        return self.stages[-1]


@functools.lru_cache(maxsize=1)
def _leaves() -> tuple[str, ...]:
    from pretrain.checkpoint.contract import config_fields

    return tuple(config_fields())


@functools.lru_cache(maxsize=1)
def _must_match() -> dict[str, str]:
    from pretrain.checkpoint.contract import FIELDS, MATCH

    return {key: how for key, (cls, how) in FIELDS.items() if cls == MATCH}


@functools.lru_cache(maxsize=1)
def _unused_on_resume() -> dict[str, str]:
    from pretrain.checkpoint.contract import FIELDS, UNUSED

    return {key: how for key, (cls, how) in FIELDS.items() if cls == UNUSED}


def _whole(value) -> int | None:
    """A positive whole number (1e13 and "1e13", as YAML reads them, included), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number >= 1 and number == int(number) else None


def plain(cfg: Config) -> StagedConfig:
    """A config without stages: one unnamed stage, the config itself."""
    t = cfg.train
    done = None
    if t.rampup_batch_size is not None and t.steps > 0:
        try:
            done = walk(t.rampup_batch_size, t.global_batch_size, 0, cfg.model.seq_length, steps=t.steps)
        except Exception:  # noqa: BLE001 - a ramp Megatron's calculator refuses: validation's ramp rule names it
            done = None
    if done is None:
        done = StageSamples(t.steps, t.steps * t.global_batch_size, t.steps * t.global_batch_size
                            * cfg.model.seq_length, (t.global_batch_size,))
    stage = Stage(0, "", 0, t.steps, 0, done.samples, done.tokens, done.batch_sizes, cfg)
    return StagedConfig((stage,), t.steps, staged=False)


def _check_key(p: Report, label: str, key, tree: dict, later: bool) -> bool:
    """Whether a stage may set `key` (else the problem, did-you-mean as overrides say it). `later`: a stage after
    the first, which starts from the checkpoint of the one before (a key not used on resume would do nothing)."""
    if not isinstance(key, str) or key not in _leaves():
        probe = copy.deepcopy(tree)
        try:
            set_dotted(probe, str(key), None)
            config_from_dict(probe)
            why = f"'{key}' is a section, not a key: set its keys one by one (e.g. {key}.NAME: VALUE)"
        except ConfigError as exc:
            why = str(exc)
        p.error(f"stages.set.{key}", why, "use the dotted keys of command-line overrides (section.key)", label=label)
        return False
    if key in FRAME:
        p.error(key, f"a stage cannot set {key}: {FRAME[key]}", f"remove {key} from the stage's set", label=label)
        return False
    if key in _must_match():
        p.error(key, f"a stage cannot set {key}: {_must_match()[key]} (the resume contract: must match; "
                "docs/checkpoints.md, Resuming)", f"set {key} before the stages, for the whole run", label=label)
        return False
    if later and key in _unused_on_resume():
        p.error(key, f"a stage after the first cannot set {key}: it starts from the previous stage's "
                f"checkpoint, and {key} is not used on resume ({_unused_on_resume()[key]})",
                f"set {key} before the stages (or in the first stage's set)", label=label)
        return False
    return True


def _length(p: Report, label: str, raw: dict) -> tuple[int | None, int | None]:
    """(steps, tokens) of a stage: exactly one given, a positive whole number."""
    has_steps, has_tokens = "steps" in raw, "tokens" in raw
    if has_steps == has_tokens:
        p.error(("stages.steps", "stages.tokens"), "a stage needs its length: steps or tokens (one of them)",
                "give steps: N or tokens: N", label=label)
        return None, None
    key = "steps" if has_steps else "tokens"
    value = _whole(raw[key])
    if value is None:
        p.error(f"stages.{key}", f"{key}={raw[key]!r} must be a positive whole number",
                f"give {key}: N with N >= 1", label=label)
        return None, None
    return (value, None) if has_steps else (None, value)


def _keep(p: Report, label: str, raw: dict, sets: dict, before: Config | None, tree: dict) -> int | None:
    """`keep`: a changed model.seq_length keeps the batch's tokens or samples. Returns train.global_batch_size
    rescaled (keep: tokens), for the stage to set; None when the batch stays as it is. `tree`: the config before
    the stage's `set`."""
    keep = raw.get("keep")
    seq_before = before.model.seq_length if before is not None else None
    seq = sets["model.seq_length"] if "model.seq_length" in sets else tree.get("model", {}).get("seq_length",
                                                                                              seq_before)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        return None  # not a length: the config's own check names it
    changed = before is not None and seq != seq_before
    if keep is not None and keep not in ("tokens", "samples"):
        p.error("stages.keep", f"keep={keep!r} is not one of tokens, samples", "keep: tokens or keep: samples",
                label=label)
    elif keep is not None and not changed:
        p.error("stages.keep", "keep applies where a stage changes model.seq_length; this one does not",
                "remove keep", label=label)
    elif keep is not None and "train.global_batch_size" in sets:
        p.error(("stages.keep", "train.global_batch_size"), "keep and train.global_batch_size both size the "
                "batch", "give one of them", label=label)
    elif changed and keep is None and "train.global_batch_size" not in sets:
        gbs = before.train.global_batch_size
        p.error(("stages.keep", "model.seq_length"), f"model.seq_length changes {seq_before} → {seq}: say "
                f"whether the batch keeps its {gbs * seq_before:,} tokens (keep: tokens) or its {gbs} samples, "
                f"{gbs * seq:,} tokens (keep: samples)", "add keep: tokens or keep: samples (or set "
                "train.global_batch_size)", label=label)
    elif keep == "tokens":
        gbs = before.train.global_batch_size
        if (gbs * seq_before) % seq:
            p.error(("stages.keep", "model.seq_length"), f"keep: tokens: {gbs * seq_before:,} tokens per batch "
                    f"is no whole number of sequences of {seq}", "keep: samples, or set train.global_batch_size",
                    label=label)
        else:
            return gbs * seq_before // seq
    return None


def _one(p: Report, i: int, raw, tree: dict, before: Config | None, names: set) -> tuple:
    """(label, config, sets, steps, tokens) of stage `i`; config None when it cannot be resolved."""
    name = raw.get("name") if isinstance(raw, dict) else None
    label = f"stage '{name}'" if isinstance(name, str) and name else f"stages[{i}]"
    if not isinstance(raw, dict):
        p.error("stages", f"a stage is a mapping {{name, steps | tokens, set}}, got {raw!r}",
                "write each stage as {name: NAME, steps: N, set: {...}}", label=label)
        return label, None, {}, None, None
    for key in raw:
        if key not in STAGE_FIELDS:
            close = difflib.get_close_matches(str(key), STAGE_FIELDS, n=1)
            p.error(f"stages.{key}", f"unknown stage key '{key}'" + (f" (did you mean '{close[0]}'?)"
                                                                            if close else ""),
                    f"a stage has {', '.join(STAGE_FIELDS)}", label=label)
    if not isinstance(name, str) or not name.strip():
        p.error("stages.name", "a stage needs a name", "give name: NAME (letters, digits, _ . -)", label=label)
    elif not NAME.match(name):
        p.error("stages.name", f"name {name!r} must be letters, digits, _ . - (it names the stage's "
                "checkpoint and metrics)", "rename it", label=label)
    elif name in names:
        p.error("stages.name", f"the name '{name}' is used by an earlier stage", "give each stage its own name",
                label=label)
    names.add(name)
    steps, tokens = _length(p, label, raw)
    sets = raw.get("set") or {}
    if not isinstance(sets, dict):
        p.error("stages.set", f"set must be a mapping of dotted keys, got {sets!r}",
                "set: {data.blend: [...], optimizer.lr: ...}", label=label)
        return label, None, {}, steps, tokens
    kept = Report(0)  # keep's problems follow those of the keys
    batch = _keep(kept, label, raw, sets, before, tree)
    ok = [_check_key(p, label, key, tree, later=i > 0) for key in sets]
    p.errors.extend(kept.errors)
    sets = dict(sets, **({"train.global_batch_size": batch} if batch is not None else {}))
    staged_tree = copy.deepcopy(tree)
    for key, value in sets.items():
        if key in _leaves():
            set_dotted(staged_tree, key, value)
    if not all(ok):
        return label, None, sets, steps, tokens
    try:
        return label, config_from_dict(staged_tree), sets, steps, tokens
    except ConfigError as exc:
        p.error("stages.set", str(exc), "correct the stage's set", label=label)
        return label, None, sets, steps, tokens


def derive(cfg: Config) -> StagedConfig:
    """The stages of `cfg` (a config without `stages`: `plain`), each config resolved, with every problem."""
    if not cfg.stages:
        return plain(cfg)
    p = Report(0)  # the stages' problems (their label first); no world size yet
    tree = cfg.to_dict()
    tree.pop("stages")
    tree["train"]["steps"] = 1  # each stage's is the run's length, set below
    stages: list[Stage] = []
    names: set = set()
    before, start, sample = None, 0, 0
    for i, raw in enumerate(cfg.stages):
        label, stage_cfg, sets, steps, tokens = _one(p, i, raw, tree, before, names)
        if stage_cfg is None:
            continue
        if steps is None and tokens is None:  # no length: the stages after it start from its config
            tree = stage_cfg.to_dict()
            tree.pop("stages")
            before = stage_cfg
            continue
        t = stage_cfg.train
        if t.rampup_batch_size and len(t.rampup_batch_size) == 3 and sample > t.rampup_batch_size[2]:
            t.rampup_batch_size = None  # the ramp ended before this stage: its batch is train.global_batch_size
        try:
            done = walk(t.rampup_batch_size, t.global_batch_size, sample, stage_cfg.model.seq_length, steps=steps,
                        tokens=tokens)
        except TokensNotExact as exc:
            (lo, lo_tokens), (hi, hi_tokens) = exc.below, exc.above
            p.error("stages.tokens", f"tokens={tokens:,} is no whole number of steps (global batch "
                    f"{t.global_batch_size} × sequence {stage_cfg.model.seq_length}): it falls between {lo:,} step(s) "
                    f"({lo_tokens:,} tokens) and {hi:,} step(s) ({hi_tokens:,} tokens)",
                    f"give tokens: {hi_tokens} or steps: {hi}" + (f" (or tokens: {lo_tokens})" if lo else ""),
                    label=label)
            continue
        except Exception as exc:  # noqa: BLE001 - a ramp Megatron's calculator refuses: validation names it
            p.error("train.rampup_batch_size", f"Megatron-Core's calculator refuses the ramp ({exc})",
                    "see the train.rampup_batch_size problem", label=label)
            continue
        stages.append(Stage(i, raw["name"], start, done.steps, sample, done.samples, done.tokens, done.batch_sizes,
                            stage_cfg, sets))
        tree = stage_cfg.to_dict()
        tree.pop("stages")
        before, start, sample = stage_cfg, start + done.steps, sample + done.samples
    if cfg.train.steps and cfg.train.steps != start and len(stages) == len(cfg.stages):
        p.error("train.steps", f"train.steps={cfg.train.steps} conflicts with the stages, whose steps add up to "
                f"{start:,}", f"leave train.steps out (the stages set the run's length) or make it {start}")
    for stage in stages:
        stage.cfg.train.steps = start
        stage.cfg.stages = None
    return StagedConfig(tuple(stages), start, tuple(p.errors))
