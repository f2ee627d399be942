"""The body of tests/gpu/run.sh: few-layer models at Llama-3-8B and -70B width on one GPU, each case a
`benchmarks/train_throughput.py` run in its own process, then one table.

Cases (bf16, sequence 4096, micro batch 1, global batch 4, 8 steps, means over the last 5):
  - 8B width (4 layers, vocabulary 128,256) and 70B width (2 layers, vocabulary 32,000), local spec;
  - the same with the Transformer Engine spec, and with TE + FP8, when `import transformer_engine` works
    (FP8 only on compute capability >= 8.9).
The whole check keeps to BUDGET_S; cases that would not fit are reported as skipped.
Exit status: 0 when every case that ran succeeded, 1 otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 450.0  # leaves margin under 8 minutes for start-up and the table
CASE_LIMIT_S = 160.0
MIN_CASE_S = 60.0

COMMON = ["data.mock=true", "train.precision=bf16", "model.seq_length=4096", "train.micro_batch_size=1",
          "train.global_batch_size=4", "parallel.tensor=1", "parallel.pipeline=1", "parallel.context=1",
          "optimizer.distributed=false", "optimizer.warmup_steps=0", "logging.log_interval=1"]  # fmt: skip
WIDTHS = {
    "8B width, 4 layers": ["model.preset=llama3_8b", "model.num_layers=4"],
    "70B width, 2 layers": ["model.preset=llama3_70b", "model.num_layers=2", "model.vocab_size=32000"],
}


def te_info() -> tuple[bool, str | None]:
    """(TE importable with CUDA, FP8 recipe to use or None)."""
    import torch

    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False, None
    if torch.cuda.get_device_capability() < (8, 9):
        return True, None
    version = tuple(int(x) for x in transformer_engine.__version__.split(".")[:2] if x.isdigit())
    return True, "tensorwise" if version >= (2, 2) else "delayed"


def cases() -> list[tuple[str, list[str]]]:
    te, fp8 = te_info()
    out = []
    specs = [("local bf16", ["model.transformer_impl=local"])]
    if te:
        specs.append(("TE bf16", ["model.transformer_impl=transformer_engine"]))
    if fp8:
        specs.append((f"TE FP8 {fp8}", ["model.transformer_impl=transformer_engine", f"model.fp8={fp8}"]))
    for spec, spec_overrides in specs:
        for width, width_overrides in WIDTHS.items():
            out.append((f"{width}, {spec}", COMMON + width_overrides + spec_overrides))
    return out


def main() -> int:
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.train_throughput import HEADER, format_row

    start = time.monotonic()
    device = torch.cuda.get_device_name()
    todo = cases()
    print(f"GPU check on {device}: {len(todo)} case(s), budget {BUDGET_S:.0f} s", flush=True)
    rows, failures, skipped = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, overrides) in enumerate(todo):
            left = BUDGET_S - (time.monotonic() - start)
            if left < MIN_CASE_S:
                skipped.append(label)
                continue
            out = Path(tmp) / f"case{i}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks/train_throughput.py"), "tiny_llama", *overrides,
                   "--steps", "8", "--warmup", "3", "--label", label, "--json-out", str(out)]  # fmt: skip
            t0 = time.monotonic()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(CASE_LIMIT_S, left))
            except subprocess.TimeoutExpired:
                failures.append((label, f"timed out after {min(CASE_LIMIT_S, left):.0f} s"))
                continue
            took = time.monotonic() - t0
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                failures.append((label, f"exit {proc.returncode}: {tail}"))
                continue
            rows.append(json.loads(out.read_text()))
            print(f"  done: {label} ({took:.0f} s)", flush=True)
    print()
    print(HEADER)
    for r in rows:
        print(format_row(r["label"], r))
    for label in skipped:
        print(f"{label:<34} skipped (time budget)")
    for label, why in failures:
        print(f"{label:<34} FAILED: {why}")
    off = [r["label"] for r in rows if r.get("mem_ratio") and not 0.8 <= r["mem_ratio"] <= 1.2]
    if off:
        print(f"note: measured peak memory is more than 20% away from the plan for: {', '.join(off)}")
    print(f"total {time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
