"""Quickstart on the embedded default data: preprocess → train tiny_llama on 2 CPU processes → export.

    make quickstart        (or: .venv/bin/python scripts/quickstart.py [--steps N] [--nproc N])

Everything goes to a new folder runs/quickstart-<timestamp>/ (earlier runs are never touched).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(cmd: list[str], **kwargs) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kwargs)


def main() -> int:
    from data_tools.assets import DEFAULT_CORPUS, MISTRAL_TOKENIZER

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--skip-hf", action="store_true", help="skip the HuggingFace export and generation")
    args = ap.parse_args()

    started = time.perf_counter()
    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("quickstart-%Y%m%d-%H%M%S")).resolve()
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    prefix = data_dir / "python_docs"

    print(f"\n== 1/3 preprocess the embedded corpus ({DEFAULT_CORPUS.name}) with the Mistral tokenizer", flush=True)
    run([py, "-m", "data_tools", "preprocess", "--input", str(DEFAULT_CORPUS), "--output-prefix", str(prefix),
         "--tokenizer-type", "sentencepiece", "--tokenizer-model", str(MISTRAL_TOKENIZER), "--append-eod",
         "--workers", "2"])
    dataset = f"{prefix}_text_document"

    print(f"\n== 2/3 train tiny_llama for {args.steps} steps on {args.nproc} CPU processes", flush=True)
    overrides = [
        "data.mock=false", f"data.blend=[{dataset}]", f"run.dir={run_dir}", f"train.steps={args.steps}",
        "checkpoint.interval=20", "optimizer.warmup_steps=4", "optimizer.lr=3e-3", "optimizer.min_lr=3e-4",
        "optimizer.distributed=true",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.nproc > 1:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "pretrain", "train", "tiny_llama", *overrides]
    else:
        cmd = [py, "-m", "pretrain", "train", "tiny_llama", *overrides]
    run(cmd, env=env)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [x["loss"] for x in lines if "loss" in x]
    hf_dir = run_dir / "hf"
    if not args.skip_hf and (ROOT / "scripts" / "quickstart_hf.py").exists():
        print("\n== 3/3 export to HuggingFace and generate with transformers", flush=True)
        run([py, str(ROOT / "scripts" / "quickstart_hf.py"), str(run_dir)])
    elapsed = time.perf_counter() - started
    print("\n== quickstart done", flush=True)
    print(f"  loss: {losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step {len(losses)})")
    print(f"  run dir:      {run_dir}")
    print(f"  dataset:      {dataset}.bin/.idx")
    print(f"  metrics:      {run_dir / 'metrics.jsonl'}")
    print(f"  tensorboard:  tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"  checkpoints:  {run_dir / 'checkpoints'}")
    if hf_dir.exists():
        print(f"  HF model:     {hf_dir}")
    print(f"  wall time:    {elapsed:.0f} s")
    if not losses[-1] < losses[0]:
        print("quickstart: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
