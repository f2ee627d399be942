"""The context-parallel part of tests/gpu/run.sh: Transformer Engine's CP attention against the CPU one.

On CPU, CI checks the local spec's context-parallel attention (`model_providers/core/cp_attention.py`) against one
rank. This part settles whether Transformer Engine's CP attention (what a GPU run uses) trains to the same losses:
the same tiny_llama weights (layout-invariant init) and mock data (documents of random lengths, each ending in EOD),
without and with per-document masks (`data.reset_attention_mask`: packed sequences in THD form, `cu_seqlens` from
the EOD positions, the very `pretrain.data.datasets.pack_documents` the CPU runs use):

  - reference: CP2 p2p on CPU (two gloo processes, CUDA hidden, fp32): the run CI checks against one rank;
  - Transformer Engine bf16: CP1 on one GPU, CP2 p2p and CP2 a2a on two GPUs.

Every TE loss must be within `TOLERANCE` (bf16 against fp32) of the CPU reference, step by step. With packed
documents it also checks that `model_providers.core.cp_layout.thd_partition_index` picks the same tokens as TE's
`tex.thd_get_partitioned_indices`. CP2 needs two GPUs: with one, those cases are reported as skipped.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQ, STEPS = 1024, 3
TOLERANCE = 2e-2  # bf16 (TE) against fp32 (CPU) over 3 steps
COMMON = ["data.mock=true", f"model.seq_length={SEQ}", "train.micro_batch_size=1", "train.global_batch_size=4",
          f"train.steps={STEPS}", "optimizer.warmup_steps=0", "checkpoint.interval=null",
          "checkpoint.save_at_end=false", "logging.tensorboard=false", "train.exit_signal_handler=false"]
DOCUMENTS = ["data.eod_mask_loss=true", "data.reset_position_ids=true", "data.reset_attention_mask=true"]
CASE_LIMIT_S = 150.0


@dataclass
class CpCase:
    label: str
    nproc: int
    overrides: list[str]
    cpu: bool = False  # CUDA hidden: the CPU attention on gloo
    documents: bool = False
    losses: list[float] = field(default_factory=list)

    def command(self, run_dir: Path) -> list[str]:
        launcher = [sys.executable, "-m", "pretrain"] if self.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
            "-m", "pretrain"]
        return [*launcher, "train", "tiny_llama", *COMMON, *self.overrides, f"run.dir={run_dir}"]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if self.cpu:
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="4")
        return env


def cases() -> list[CpCase]:
    """The CPU reference first, then Transformer Engine, for plain causal attention and for packed documents."""
    out = []
    for documents in (False, True):
        extra = DOCUMENTS if documents else []
        name = "documents (THD)" if documents else "causal"
        te = ["model.transformer_impl=transformer_engine", "train.precision=bf16"]
        out += [CpCase(f"CP2 p2p CPU attention fp32, {name}", 2, ["parallel.context=2", *extra], cpu=True,
                       documents=documents),
                CpCase(f"CP1 TE bf16, {name}", 1, [*te, *extra], documents=documents),
                CpCase(f"CP2 p2p TE bf16, {name}", 2, [*te, "parallel.context=2", *extra], documents=documents),
                CpCase(f"CP2 a2a TE bf16, {name}", 2, [*te, "parallel.context=2", "parallel.cp_comm_type=a2a", *extra],
                       documents=documents)]
    return out


def losses(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["loss"] for x in path.read_text().splitlines() if '"loss"' in x]


def max_relative(got: list[float], reference: list[float]) -> float | None:
    """Largest step-wise |got − reference| / |reference|; None when the runs do not have the same steps."""
    if not got or len(got) != len(reference):
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(got, reference))


def partition_matches_te(cp: int = 2) -> str:
    """'yes' / 'NO' / why not checked: our THD partition against `tex.thd_get_partitioned_indices`."""
    try:
        import torch
        import transformer_engine_torch as tex
    except Exception as exc:  # no TE here
        return f"not checked ({type(exc).__name__})"
    from model_providers.core.cp_layout import thd_partition_index

    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randint(1, 40, (7,), generator=gen) * 2 * cp).tolist()
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).cuda()
    total = int(cu[-1])
    for rank in range(cp):
        ours = thd_partition_index(cu, cp, rank).cpu()
        theirs = tex.thd_get_partitioned_indices(cu, total, cp, rank).cpu().long()
        if not torch.equal(ours, theirs):
            return "NO"
    return "yes"


def run(budget_s: float, tmp: Path, gpus: int) -> tuple[list[CpCase], list[tuple[str, str]], list[tuple[str, str]]]:
    """Run the cases that fit in `budget_s`: (done, failures, skipped with the reason)."""
    start = time.monotonic()
    done, failures, skipped = [], [], []
    for i, case in enumerate(cases()):
        left = budget_s - (time.monotonic() - start)
        if not case.cpu and case.nproc > gpus:
            skipped.append((case.label, f"needs {case.nproc} GPUs, {gpus} here"))
            continue
        if left < 30:
            skipped.append((case.label, "time budget"))
            continue
        run_dir = tmp / f"cp{i}"
        try:
            proc = subprocess.run(case.command(run_dir), cwd=ROOT, env=case.env(), capture_output=True, text=True,
                                  timeout=min(CASE_LIMIT_S, left))
        except subprocess.TimeoutExpired:
            failures.append((case.label, "timed out"))
            continue
        case.losses = losses(run_dir)
        if proc.returncode != 0 or len(case.losses) != STEPS:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            failures.append((case.label, f"exit {proc.returncode}: {tail}"))
            continue
        done.append(case)
    return done, failures, skipped


def table(done: list[CpCase]) -> tuple[list[str], list[tuple[str, str]]]:
    """Lines of the agreement table and the disagreements (as failures)."""
    lines = [f"{'context parallelism: run':<44} {'losses':<34} {'max rel vs CPU':>15}"]
    bad = []
    refs = {c.documents: c for c in done if c.cpu}
    for c in done:
        ref = refs.get(c.documents)
        rel = max_relative(c.losses, ref.losses) if ref is not None and c is not ref else None
        shown = "reference" if c is ref else (f"{rel:.2e}" if rel is not None else "n/a")
        lines.append(f"{c.label:<44} {' '.join(f'{x:.5f}' for x in c.losses):<34} {shown:>15}")
        if rel is not None and rel > TOLERANCE:
            bad.append((c.label, f"losses {rel:.2e} from the CPU attention's (tolerance {TOLERANCE})"))
    return lines, bad


def dry_run() -> list[str]:
    lines = [f"context parallelism: {len(cases())} run(s), TE losses within {TOLERANCE} of the CPU attention's:"]
    for c in cases():
        lines.append(f"  {c.label:<44} {'CPU' if c.cpu else 'GPU'} x{c.nproc}")
        lines.append(f"    {shlex.join(c.command(Path('RUN_DIR'))[1:])}")
    return lines
