"""What `train` will start from, checked by `validate` before a launch: the run's own checkpoint under the resume
contract, or `checkpoint.pretrained`'s weights.

`pretrain.checkpoint.resume.preview_start` decides it with the functions train calls at start (`resume_step`,
the run's other checkpoint roots, `check_resume`: the model's identity, the tokenizer by identity, the optimizer
switch; an optimizer state that cannot cross formats; the checkpoint's format, index and files), reading only: an
interrupted commit is described, not finished. `validate` prints `resume from step N of DIR: what changes`, or
the refusal train would stop with (an error: exit 2). The tensors are compared with the model's only when train
builds it.

Verdict cache: an accepted start (its lines) is kept beside Megatron-Core's verdicts in `data.cache_dir` under
`start_checks/`, keyed by the whole config, the tokenizer's identity, the installation, the code, and the
checkpoint files the decision read (`pretrain.checkpoint.format.root_stamp` of every checkpoint root of the run,
the run dir's `config.yaml` and `checkpoint_dirs.txt`, and `checkpoint.pretrained`'s directories): a new save, a
moved tracker or an edited run_config.yaml is another key, re-checked (which imports torch, ~2 s). A refusal is
never cached. Entries are written with the other verdicts, only when the whole validation passed.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pretrain.problems import Report
from pretrain.rules import megatron_verdicts

VERDICT_DIR = "start_checks"
VERDICT_FORMAT = "megapretrain-start-check"
VERDICT_VERSION = 1


def _text(path: Path) -> str | None:
    try:
        return path.read_bytes()[:65536].decode("utf-8", "replace")
    except OSError:
        return None


def start_facts(cfg, tokenizer) -> dict[str, Any] | None:
    """What the start decision depends on (see the module), None when there is nothing to decide: no checkpoint
    root holds a tracker, a commit journal or an `iter_*` directory, and no `checkpoint.pretrained` (a fresh start)."""
    from pretrain.checkpoint.format import COMMIT_JOURNAL, TRACKER, iteration_stamp, root_stamp
    from pretrain.compat import matrix
    from pretrain.run.run_dir import CHECKPOINT_DIRS, checkpoint_root, checkpoint_roots

    roots = [root_stamp(p) for p in dict.fromkeys([checkpoint_root(cfg), *checkpoint_roots(cfg.run.dir)])]
    pretrained = cfg.checkpoint.pretrained
    if not pretrained and not any(len(s) > 3 or s[TRACKER] is not None or s[COMMIT_JOURNAL] is not None
                                  for s in roots):
        return None
    source = None
    if pretrained:
        p = Path(pretrained)
        source = {"path": str(p.resolve()), "self": iteration_stamp(p), "root": root_stamp(p),
                  "checkpoints": root_stamp(p / "checkpoints")}
    run_dir = Path(cfg.run.dir)
    return {"format": VERDICT_FORMAT, "version": VERDICT_VERSION, "config": cfg.to_dict(),
            "tokenizer": tokenizer.record() if tokenizer is not None else None, "roots": roots,
            "run_dir": {name: _text(run_dir / name) for name in ("config.yaml", CHECKPOINT_DIRS)},
            "pretrained": source, "installed": matrix.installed().summary(),
            "code": megatron_verdicts._code_digest()}


def start_rules(r: Report, plan, cache: bool = True) -> None:
    """`validate` (the CLI): what train will start from, as notes in `r`, or the refusal train would stop with (an
    error), for the run plan `plan` (its config, tokenizer and data cache dir). `cache`: answer from a current
    verdict when there is one."""
    cfg, tokenizer = plan.cfg, plan.tokenizer
    facts = start_facts(cfg, tokenizer)
    if facts is None:
        return
    facts = json.loads(json.dumps(facts, sort_keys=True, default=str))  # as an entry reads back
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:40]
    cache_dir = plan.data.cache_dir
    record = megatron_verdicts.read_entry(cache_dir, key, facts, VERDICT_DIR) if cache else None
    if record is not None and isinstance(record.get("result"), list):
        r.notes += [str(line) for line in record["result"]]
        r.notes.append("the start above was checked before against this exact config, code and checkpoint files: "
                       f"verdict from the cache {Path(cache_dir) / VERDICT_DIR}")
        return
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.checkpoint.resume import preview_start

    try:
        lines = preview_start(plan)
    except (CheckpointError, OSError) as exc:
        _refused(r, cfg.checkpoint, str(exc))
        return
    except Exception:  # noqa: BLE001 - a config the rules above refused can fail the comparison itself
        if not r.errors:
            raise
        r.notes.append("what train would start from (checkpoint.dir / checkpoint.pretrained) was not checked: "
                       "the config has the errors above")
        return
    r.notes += lines
    r.start_verdicts.append((key, facts, lines))


def _refused(r: Report, c, message: str) -> None:
    """Train's refusal as a validation error, naming the config keys it names (`c`: the checkpoint section)."""
    from pretrain.checkpoint.contract import FIELDS
    from pretrain.checkpoint.resume import PRETRAINED_REFUSED

    if message.startswith(PRETRAINED_REFUSED):
        if not any("checkpoint.pretrained" in p.keys for p in r.errors):  # else `rules.run` said why already
            r.error("checkpoint.pretrained", f"train would refuse {message}",
                    "give a complete checkpoint of this model, or remove the key")
        return
    named = [k for k in FIELDS if re.search(rf"(^|[ (,]){re.escape(k)} \S+ →", message)]  # `KEY OLD → NEW`
    keys = tuple(dict.fromkeys(["checkpoint.dir" if c.dir else "run.dir", *named]))
    r.error(keys, f"train would refuse to resume: {message}",
            "change what the message names, or give a run.dir (and checkpoint.dir) without checkpoints for a new run")
