"""The layout runs a model family's test file shares (test_gpt_oss.py, test_nemotron_h.py, test_qwen3_next.py): a
tiny preset trained 4 steps in fp32 on mock data, one rank against each layout on 2 ranks (pool cases), and, in
`make test-all`, packed documents against the documents alone."""

from __future__ import annotations

from pathlib import Path

from tests import tiers
from tests.pretrain.ckpt_helpers import by_step, layout_case, max_rel, rel_diff, run_worker_cases, step_values
from tests.pretrain.doc_helpers import FLAGS, case, documents

STEPS = 4
TOLERANCE = 1e-5
BASE = ["data.mock=true", f"train.steps={STEPS}", "train.precision=fp32", "train.global_batch_size=4",
        "train.micro_batch_size=2", "checkpoint.save_at_end=false", "checkpoint.interval=null",
        "logging.tensorboard=false", "optimizer.warmup_steps=1"]
TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true"]


def doc_case(config: str, run_dir: Path, data_prefix: str, seq_length: int, extra: list[str] = ()) -> dict:
    """A packed-document (or single-document) case of `config` in fp32."""
    return {**case(run_dir, data_prefix, seq_length, ["train.precision=fp32", *extra]), "config": config}


def family_runs(root: Path, config: str, layouts: dict, full: set, doc_layouts: dict, more_world1: list = (),
                timeout: int = 1800) -> tuple[Path, dict]:
    """Run the reference on world 1 and `layouts` ({name: (overrides, copy_from)}; those in `full` only in
    `make test-all`) on world 2; in `make test-all` also each document alone and `doc_layouts` ({name: overrides}:
    world 2 where it has overrides) plus `more_world1` cases. Returns (root, the documents' prediction counts)."""
    by_world = {1: [layout_case(root, config, BASE, "ref", [], None)],
                2: [layout_case(root, config, BASE, name, extra, source)
                    for name, (extra, source) in tiers.pick(layouts, full).items()]}
    singles = {}
    if tiers.everything():
        by_world[1] += list(more_world1)
        packed, seq, singles = documents(root)
        for name, (path, n) in singles.items():
            by_world[1].append(doc_case(config, root / f"doc_{name}", path, n))
        for name, extra in doc_layouts.items():
            by_world[2 if extra else 1].append(doc_case(config, root / name, packed, seq, FLAGS + extra))
    for world, cases in by_world.items():
        (root / f"w{world}").mkdir()
        run_worker_cases(root / f"w{world}", world, cases, timeout=timeout)
    return root, {name: n for name, (_, n) in singles.items()}


def assert_layout_matches_one_rank(root: Path, config: str, name: str, aux_key: str) -> None:
    """Layout `name`'s losses, gradient norms and router losses (`aux_key`) equal the one-rank run's to TOLERANCE
    relative at every step; the routing of step 1 is the same; the model learned."""
    ref, got = by_step(root / "ref"), by_step(root / name)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    loss = max_rel(step_values(root / name, "loss"), step_values(root / "ref", "loss"))
    norm = max_rel(step_values(root / name, "grad_norm"), step_values(root / "ref", "grad_norm"))
    aux = max(rel_diff(got[s][aux_key], ref[s][aux_key]) for s in ref)
    print(f"| {config} | {name} | loss {loss:.1e} | grad norm {norm:.1e} | aux loss {aux:.1e} |")
    assert loss <= TOLERANCE and norm <= TOLERANCE and aux <= TOLERANCE, (name, loss, norm, aux)
    assert got[1]["moe_tokens_per_expert"] == ref[1]["moe_tokens_per_expert"]
    assert got[STEPS]["loss"] != got[1]["loss"]
