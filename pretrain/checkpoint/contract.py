"""The resume contract: what a resumed run may change and what it must keep, for every config field (one owner).

Before a checkpoint loads, `check_resume` compares the config it was written with (its `run_config.yaml`) and
the tokenizer it recorded with this run's, field by field. Every leaf of the config tree has one class in
`FIELDS` (`tests/pretrain/test_resume_contract.py` fails when a field is added without one):

- `MATCH`: must match, else the resume is refused naming each key (the model's identity and the tokenizer,
  compared by identity: kind + SHA-256 of its files, not by path or vocabulary size);
- `CHANGE`: changes and takes effect from the resumed step, printed as `resume: KEY OLD → NEW (what happens)`;
- `UNUSED`: not used by a resumed run (printed as well when it differs).

After the load, `apply_new_schedule` makes the new optimizer hyperparameters and LR schedule the ones that run:
the checkpoint contributes the optimizer *state* (moments, Adam step) and the scheduler's step count; the
learning rate, its schedule, betas, eps and weight decay come from this run's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_providers.core.knobs import CHANGE, MATCH, UNUSED, leaves, resume_of
from pretrain.checkpoint.format import CheckpointError, read_saved_config
from pretrain.config import Config

__all__ = ["CHANGE", "FIELDS", "MATCH", "TOKENIZER_KEYS", "UNUSED", "apply_new_schedule", "check_resume",
           "config_fields", "hyperparameters", "resume_fields", "resume_table"]

TOKENIZER_KEYS = ("data.tokenizer_type", "data.tokenizer_model", "data.vocab_file", "data.merge_file")
TOKENIZER_STATE = "tokenizer"  # common-state key: TokenizerIdentity.to_dict(), or None for "no tokenizer"


def resume_fields(cls: type | None = None) -> dict[str, tuple[str, str]]:
    """(class, what happens on resume) of every leaf of the config tree (`Config` by default) that declares one: its
    own `knob(resume=...)`, else its section's `RESUME` (`pretrain/config.py`, `pretrain/sections/`)."""
    if cls is None:
        cls = Config
    rules = {key: resume_of(section, f) for key, section, f in leaves(cls)}
    return {key: (rule.cls, rule.how) for key, rule in rules.items() if rule is not None}


def resume_table() -> list[tuple[str, str, str, list[str]]]:
    """docs/checkpoints.md's "Resuming" table: (section, class, what happens, fields), in the config's order."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    for key, (cls, how) in FIELDS.items():
        section, _, name = key.rpartition(".")
        rows.setdefault((section, cls, how), []).append(name)
    return [(*row, names) for row, names in rows.items()]


# (class, what happens on resume) for every leaf of the config tree, from the fields' declarations; docs/checkpoints.md
# "Resuming" shows it (`python -m pretrain.checkpoint.contract` prints that table).
FIELDS: dict[str, tuple[str, str]] = resume_fields()


def config_fields(cls: type | None = None) -> list[str]:
    """Dotted names of every leaf field of the config tree (`Config` by default)."""
    return [key for key, _, _ in leaves(cls or Config)]


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    """A value as YAML writes it (null, true, 0.001, [1.0, a])."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


# --------------------------------------------------------------------------------------------------
# The tokenizer's identity
# --------------------------------------------------------------------------------------------------


def _saved_identity(common: dict, saved: dict[str, Any]):
    """(identity or None, note): the checkpoint's recorded tokenizer, else the one its run_config.yaml names."""
    from pretrain.tokenizer.choice import identity_of
    from pretrain.tokenizer.identity import TokenizerIdentity

    if TOKENIZER_STATE in common:
        record = common[TOKENIZER_STATE]
        return (None if record is None else TokenizerIdentity.from_dict(record)), None
    args = [saved.get(k) for k in TOKENIZER_KEYS]
    try:
        return identity_of(*args), ("the checkpoint records no tokenizer identity (written before they were "
                                  "recorded): compared with the tokenizer its run_config.yaml names")
    except Exception:  # noqa: BLE001 - its files are gone: compare the keys
        return None, ("the checkpoint records no tokenizer identity and the tokenizer files its run_config.yaml "
                      "names are unreadable: compared the data.tokenizer_* keys")


# --------------------------------------------------------------------------------------------------
# The check before loading
# --------------------------------------------------------------------------------------------------


def check_resume(cfg, path: Path, common: dict, tokenizer=None) -> list[str]:
    """Compare the checkpoint at `path` (its run_config.yaml and recorded tokenizer) with `cfg` (every section: the
    contract covers the whole tree) and its tokenizer (`tokenizer`: the run plan's `TokenizerPlan`; None: decided
    here by `pretrain.tokenizer.choice.decide`, for callers without a plan).

    Returns the lines to print (`resume: KEY OLD → NEW (what happens)` and notes); raises CheckpointError naming
    every must-match key that differs.
    """
    from pretrain.layout import resolved_model_fields

    saved_tree = read_saved_config(path)
    defaults = _flatten(Config().to_dict())
    saved = {**defaults, **_flatten(saved_tree)}
    new = _flatten(cfg.to_dict())
    lines = [f"resume: {key} in the checkpoint's run_config.yaml is no longer a config key (ignored)"
             for key in _flatten(saved_tree) if key not in FIELDS]
    old_tok, note = _saved_identity(common, saved)
    if tokenizer is None:
        from pretrain.data.plan import uses_mock
        from pretrain.tokenizer.choice import decide

        tokenizer = decide(cfg.data, cfg.model.vocab_size, uses_mock(cfg.data), cfg.model.preset)
    new_tok = tokenizer.identity
    if note:
        lines.append(f"resume: note: {note}")
    new_vocab = new_tok.vocab_size if new_tok else None
    old_model = resolved_model_fields({k[6:]: v for k, v in saved.items() if k.startswith("model.")},
                                old_tok.vocab_size if old_tok else new_vocab)
    new_model = resolved_model_fields({k[6:]: v for k, v in new.items() if k.startswith("model.")}, new_vocab)
    refused: list[str] = []
    for key, (cls, how) in FIELDS.items():
        old, now = saved.get(key), new[key]
        if key in TOKENIZER_KEYS:
            continue
        if cls == MATCH and key.startswith("model."):
            old, now = old_model[key[6:]], new_model[key[6:]]
        if old == now:
            continue
        if cls == MATCH:
            refused.append(f"{key} {_show(old)} → {_show(now)}")
        else:
            lines.append(f"resume: {key} {_show(old)} → {_show(now)} ({how})")
    tokenizer_changed = [f"{k} {_show(saved.get(k))} → {_show(new[k])}" for k in TOKENIZER_KEYS
                         if saved.get(k) != new[k]]
    if old_tok is not None and new_tok is not None:
        if old_tok.sha256 != new_tok.sha256:
            raise CheckpointError(
                f"{path}: cannot resume with another tokenizer: the checkpoint was trained with {old_tok.describe()}, "
                f"this run's is {new_tok.describe()} ({', '.join(tokenizer_changed) or 'same keys, other files'}); "
                f"the embedding rows belong to the checkpoint's tokenizer. Use it, or start a new run.dir with "
                f"checkpoint.pretrained={path}")
        lines += [f"resume: {c} (the same tokenizer: {new_tok.describe()})" for c in tokenizer_changed]
    else:  # not both known: the keys must match
        refused += tokenizer_changed
    _optimizer_switch(cfg.checkpoint.load_optimizer, path, saved.get("optimizer.name"), new["optimizer.name"])
    if refused:
        raise CheckpointError(
            f"{path}: cannot resume with {', '.join(refused)}: these must match the checkpoint (the model's identity "
            f"and its tokenizer; docs/checkpoints.md, Resuming). To train a changed model from these weights, start "
            f"a new run.dir with checkpoint.pretrained={path}")
    return lines


def _optimizer_switch(load_optimizer: bool, path: Path, old: str | None, now: str) -> None:
    """AdamW ↔ Muon on resume: their states differ, so only a fresh optimizer (checkpoint.load_optimizer=false,
    recorded in config.yaml as this run's choice) may switch."""
    if old == now or not load_optimizer:
        return
    raise CheckpointError(
        f"{path}: cannot resume with optimizer.name {_show(old)} → {_show(now)} and its optimizer state: the "
        f"checkpoint holds {old}'s state, {now} keeps another (AdamW: two moments per parameter; Muon: one momentum "
        f"per matrix). Set checkpoint.load_optimizer=false to start {now} fresh from the checkpoint's weights, or "
        f"keep optimizer.name={old}")


# --------------------------------------------------------------------------------------------------
# After loading: this config's optimizer hyperparameters and LR schedule
# --------------------------------------------------------------------------------------------------

_KEPT_FROM_CHECKPOINT = ("params", "step")  # per-group values that are optimizer state, not configuration


def hyperparameters(optimizer) -> list[dict]:
    """The freshly built optimizer's param-group settings (from this config), to restore after a load."""
    return [{k: v for k, v in g.items() if k not in _KEPT_FROM_CHECKPOINT} for g in optimizer.param_groups]


def apply_new_schedule(optimizer, scheduler, fresh_groups: list[dict] | None, num_steps: int) -> None:
    """Put this config's hyperparameters back into the loaded param groups (torch's `load_state_dict` replaces
    them with the checkpoint's: lr, max_lr/min_lr, betas, eps, weight decay) and set the LR schedule, built
    from this config, at the checkpoint's step count."""
    groups = optimizer.param_groups
    if fresh_groups is not None:
        if len(fresh_groups) != len(groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this model's "
                                  f"{len(fresh_groups)}")
        for group, fresh in zip(groups, fresh_groups):
            group.update(fresh)
    scheduler.num_steps = 0
    scheduler.step(increment=num_steps)


if __name__ == "__main__":  # docs/checkpoints.md's "Resuming" table
    for _section, _cls, _how, _names in resume_table():
        print(f"| `{_section or '(top level)'}` | {', '.join(f'`{n}`' for n in _names)} | {_cls} | {_how} |")
