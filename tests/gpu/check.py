"""The body of tests/gpu/run.sh: few-layer models at Llama-3-8B and -70B width on one GPU, one table.

Cases (bf16 weights, sequence 4096, micro batch 1, 4 microbatches a step, 8 steps, means over the last 5):
  - per spec — local; Transformer Engine and TE + FP8 when `import transformer_engine` works (FP8 on compute
    capability >= 8.9):
    - 8B width (4 layers, vocabulary 128,256) through the trainer (`benchmarks/train_throughput.py`), then
      the same model through tests/gpu/mcore_loop.py (Megatron-Core called directly): our overhead;
    - 70B width (2 layers, vocabulary 32,000) through the trainer with the saved-tensor meter: activations
      measured vs planned;
  - Megatron-FSDP against the distributed optimizer on the same data: 8B width with 2 layers, fp32, local spec,
    one GPU (DP1, through Megatron-FSDP's buffers and hooks): per-step losses within FSDP_TOLERANCE, and the
    peak memory of each against its plan (skipped where validation refuses Megatron-FSDP on one data-parallel
    rank: megatron-core < 0.19);
  - last (the first skipped when time runs short), Mixture of Experts at Qwen3-30B-A3B width (2 layers, 128
    experts of 768, top-8; EP on one GPU is EP1), bf16: experts one after another (local spec) and Transformer
    Engine grouped GEMM; then the DeepSeek-V3 class at Moonlight-16B-A3B width (MLA, a dense and an MoE layer of
    64 + 2 shared experts, one MTP layer), local and TE, bf16.
Then context parallelism (tests/gpu/cp_check.py, its own CP_BUDGET_S): Transformer Engine's CP2 p2p and a2a, and
CP1, against the CPU CP attention's losses on the same weights and data, without and with packed documents (THD);
`--only cp` runs just that part. Each run is its own process. The throughput part keeps to BUDGET_S (under 8
minutes with start-up); cases that would not fit are reported as skipped. `--dry-run` prints the cases with their
planned memory and runs nothing (no GPU needed). First, `preflight.check`: torch, the project and megatron-core must
import (else the error, exit 1); without a CUDA GPU it says so and exits 0 (NVIDIA devices torch cannot use: exit 1).
Exit status: 0 when every case that ran succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import cp_check  # noqa: E402  (tests/gpu/cp_check.py: the context-parallel agreement runs)
import preflight  # noqa: E402  (tests/gpu/preflight.py: torch, the project, megatron-core and a GPU, first)

BUDGET_S = 450.0  # leaves margin under 8 minutes for start-up and the table
CP_BUDGET_S = 240.0  # the context-parallel agreement runs (tests/gpu/cp_check.py)
CASE_LIMIT_S = 150.0
MIN_CASE_S = 45.0
SEQ, MICROBATCHES, STEPS, WARMUP = 4096, 4, 8, 3
FSDP_TOLERANCE = 1e-5  # fp32: Megatron-FSDP vs the distributed optimizer, relative, every step
FSDP_PAIR = {"distributed optimizer": ["optimizer.distributed=true"], "Megatron-FSDP": ["optimizer.fsdp=true"]}

WIDTHS = {  # name: (layers, hidden, ffn, heads, groups, vocabulary, preset)
    "8B": (4, 4096, 14336, 32, 8, 128256, "llama3_8b"),
    "70B": (2, 8192, 28672, 64, 8, 32000, "llama3_70b"),
    "30B-A3B MoE": (2, 2048, 6144, 32, 4, 32000, "qwen3_30b_a3b"),  # experts: the preset's 128 × 768, top-8
    # DeepSeek-V3 class at Moonlight-16B-A3B width: MLA (no q LoRA), a dense layer then an MoE layer of 64 experts
    # of 1408 + 2 shared, top-6 with the expert bias, one MTP layer.
    "16B-A3B MLA": (2, 2048, 11264, 16, None, 32000, "moonlight_16b_a3b"),
}
MLA_EXTRA = ["model.moe_layer_freq=[0,1]", "model.mtp_num_layers=1"]
COMMON = ["data.mock=true", "train.precision=bf16", f"model.seq_length={SEQ}", "train.micro_batch_size=1",
          f"train.global_batch_size={MICROBATCHES}", "parallel.tensor=1", "parallel.pipeline=1",
          "parallel.context=1", "optimizer.distributed=false", "optimizer.warmup_steps=0",
          "logging.log_interval=1"]  # fmt: skip


@dataclass
class Case:
    label: str
    width: str
    spec: list[str]  # trainer overrides of the spec / precision
    te: bool = False
    fp8: str | None = None
    baseline: bool = False  # the Megatron-Core loop instead of the trainer
    meter: bool = False
    result: dict = field(default_factory=dict)

    def overrides(self) -> list[str]:
        layers, _, _, _, _, vocab, preset = WIDTHS[self.width]
        return [*COMMON, f"model.preset={preset}", f"model.num_layers={layers}", f"model.vocab_size={vocab}",
                *self.spec]

    def command(self, out: Path) -> list[str]:
        if self.baseline:
            layers, hidden, ffn, heads, groups, vocab, _ = WIDTHS[self.width]
            cmd = [sys.executable, str(ROOT / "tests/gpu/mcore_loop.py"), "--layers", str(layers), "--hidden",
                   str(hidden), "--ffn", str(ffn), "--heads", str(heads), "--groups", str(groups), "--vocab",
                   str(vocab), "--seq", str(SEQ), "--microbatches", str(MICROBATCHES), "--steps", str(STEPS),
                   "--warmup", str(WARMUP), "--json-out", str(out)]  # fmt: skip
            return cmd + (["--te"] if self.te else []) + (["--fp8", self.fp8] if self.fp8 else [])
        cmd = [sys.executable, str(ROOT / "benchmarks/train_throughput.py"), "tiny_llama", *self.overrides(),
               "--steps", str(STEPS), "--warmup", str(WARMUP), "--label", self.label, "--json-out", str(out)]
        return cmd + (["--meter"] if self.meter else [])


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


def cases(te: bool, fp8: str | None) -> list[Case]:
    specs = [("local bf16", ["model.transformer_impl=local"], False, None)]
    if te:
        specs.append(("TE bf16", ["model.transformer_impl=transformer_engine"], True, None))
    if te and fp8:
        specs.append((f"TE FP8 {fp8}", ["model.transformer_impl=transformer_engine", f"model.fp8={fp8}"], True, fp8))
    out = []
    for name, spec, use_te, recipe in specs:  # the overhead comparisons first
        out.append(Case(f"8B width, {name}", "8B", spec, use_te, recipe))
        out.append(Case(f"8B width, {name}, Megatron-Core loop", "8B", spec, use_te, recipe, baseline=True))
    for name, spec, use_te, recipe in specs:
        out.append(Case(f"70B width, {name}", "70B", spec, use_te, recipe, meter=True))
    fp32 = ["model.transformer_impl=local", "train.precision=fp32", "model.num_layers=2"]
    for name, optimizer in FSDP_PAIR.items():  # the same data and seed: equal losses
        out.append(Case(f"8B width 2 layers fp32, {name}", "8B", [*fp32, *optimizer]))
    for name, spec, use_te, recipe in specs[:2]:  # bf16: sequential experts (local), grouped GEMM (TE)
        out.append(Case(f"30B-A3B MoE width, {name}", "30B-A3B MoE", spec, use_te, recipe))
    for name, spec, use_te, recipe in specs[:2]:  # MLA + DeepSeek MoE + MTP: local spec, TE (fused MLA RoPE off)
        out.append(Case(f"16B-A3B MLA width, {name}", "16B-A3B MLA", [*spec, *MLA_EXTRA], use_te, recipe))
    return out


def fsdp_agreement(done: list[Case]) -> tuple[str, bool] | None:
    """(report line, within FSDP_TOLERANCE) for the Megatron-FSDP / distributed optimizer pair, None if not both ran."""
    by_label = {c.label: c for c in done}
    runs = [by_label.get(f"8B width 2 layers fp32, {name}") for name in FSDP_PAIR]
    if not all(runs) or not all(r.result.get("losses") for r in runs):
        return None
    ref, got = (r.result["losses"] for r in runs)
    if len(ref) != len(got):
        return f"Megatron-FSDP ran {len(got)} steps, the distributed optimizer {len(ref)}", False
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    ok = rel <= FSDP_TOLERANCE
    return (f"Megatron-FSDP vs distributed optimizer (fp32, same data, {len(ref)} steps): max relative loss "
            f"difference {rel:.1e} ({'within' if ok else 'ABOVE'} {FSDP_TOLERANCE:.0e})"), ok


def refusal(case: Case) -> str | None:
    """The validator's first error for the case on this one-GPU machine, None when it may run."""
    from pretrain import plan
    from pretrain.config import load_config

    if case.baseline:
        return None
    errors = plan.check_layout(load_config("tiny_llama", case.overrides()), 1, use_te=case.te)
    return errors[0] if errors else None


def planned(case: Case) -> tuple[float, float]:
    """(peak, activations) the planner gives this case on a GPU, GiB."""
    from pretrain import plan
    from pretrain.config import load_config

    cfg = load_config("tiny_llama", case.overrides())
    lay = plan.layout_of(cfg, 1, on_gpu=True, use_te=case.te)
    vocab = plan.padded_vocab_for(cfg)
    total = plan.most_loaded(cfg, lay, vocab).total / plan.GIB
    return total, plan.activation_memory(cfg, lay, vocab, 0).peak / plan.GIB


def fmt(value, spec: str) -> str:
    return spec.format(value) if isinstance(value, (int, float)) else "n/a"


def table(done: list[Case]) -> list[str]:
    header = (f"{'run':<44} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9} "
              f"{'ratio':>6} {'act meas/plan GiB':>18} {'ours/Mcore':>10}")
    lines = [header]
    by_label = {c.label: c for c in done}
    for c in done:
        r = c.result
        act = (f"{r['act_measured_gib']:.2f}/{r['act_planned_gib']:.2f}"
               if r.get("act_measured_gib") is not None and r.get("act_planned_gib") is not None else "")
        base = by_label.get(f"{c.label}, Megatron-Core loop")
        ratio = ""
        if base and base.result.get("tokens_per_s_per_gpu") and r.get("tokens_per_s_per_gpu"):
            ratio = f"{r['tokens_per_s_per_gpu'] / base.result['tokens_per_s_per_gpu']:.3f}"
        lines.append(f"{c.label:<44} {fmt(r.get('tokens_per_s_per_gpu'), '{:,.0f}'):>10} "
                     f"{fmt(r.get('tflops_per_gpu'), '{:.1f}'):>8} {fmt(r.get('mfu'), '{:.1%}'):>6} "
                     f"{fmt(r.get('peak_mem_gib'), '{:.2f}'):>9} {fmt(r.get('planned_mem_gib'), '{:.2f}'):>9} "
                     f"{fmt(r.get('mem_ratio'), '{:.2f}'):>6} {act:>18} {ratio:>10}")
    return lines


def baseline_figures(case: Case, result: dict, device: str) -> dict:
    """TFLOP/s and MFU of a Megatron-Core loop run, by the trainer's own formula and peak table."""
    from pretrain.config import load_config
    from pretrain.observe.flops import flops_per_token, gpu_peak_tflops
    from pretrain.planner import padded_vocab_for

    cfg = load_config("tiny_llama", case.overrides())
    tflops = flops_per_token(cfg.model, padded_vocab_for(cfg)) * result["tokens_per_s_per_gpu"] / 1e12
    peak = gpu_peak_tflops(device, bool(case.fp8))
    return {**result, "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the cases and their plans; run nothing")
    parser.add_argument("--json-out", default=None, help="also write every case's figures here")
    parser.add_argument("--only", choices=("all", "throughput", "cp"), default="all",
                        help="cp: only the context-parallel agreement runs; throughput: only the rest")
    args = parser.parse_args(argv)
    status, line = preflight.check(dry_run=args.dry_run)
    if status is not None:  # 0: no GPU here; 1: what failed (an import, a GPU torch cannot use)
        print(line, file=sys.stdout if status == 0 else sys.stderr, flush=True)
        return status
    if args.dry_run:
        todo = cases(te=True, fp8="tensorwise") if args.only != "cp" else []
        print(f"GPU check (dry run): {len(todo)} case(s); planned on a GPU:")
        for c in todo:
            total, act = planned(c)
            print(f"  {c.label:<44} plan {total:6.2f} GiB (activations {act:5.2f})")
            print(f"    {shlex.join(c.command(Path('OUT.json'))[1:])}")
        if args.only != "throughput":
            print("\n".join(cp_check.dry_run()))
        return 0

    import torch

    start = time.monotonic()
    device = torch.cuda.get_device_name()
    todo = cases(*te_info()) if args.only != "cp" else []
    print(f"GPU check on {device}, torch {torch.__version__}: {len(todo)} case(s), budget {BUDGET_S:.0f} s",
          flush=True)
    done, failures, skipped = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(todo):
            left = BUDGET_S - (time.monotonic() - start)
            if left < MIN_CASE_S:
                skipped.append(case.label)
                continue
            refused = refusal(case)
            if refused:  # e.g. Megatron-FSDP on one GPU where megatron-core gets it wrong at DP1
                skipped.append(f"{case.label} (refused by validation: {refused})")
                continue
            out = Path(tmp) / f"case{i}.json"
            t0 = time.monotonic()
            try:
                proc = subprocess.run(case.command(out), cwd=ROOT, capture_output=True, text=True,
                                      timeout=min(CASE_LIMIT_S, left))
            except subprocess.TimeoutExpired:
                failures.append((case.label, f"timed out after {min(CASE_LIMIT_S, left):.0f} s"))
                continue
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                failures.append((case.label, f"exit {proc.returncode}: {tail}"))
                continue
            result = json.loads(out.read_text())
            case.result = baseline_figures(case, result, device) if case.baseline else result
            if case.baseline:
                case.result["planned_mem_gib"] = planned(case)[0]
            done.append(case)
            print(f"  done: {case.label} ({time.monotonic() - t0:.0f} s)", flush=True)
        cp_done, cp_failures, cp_skipped = [], [], []
        if args.only != "throughput":
            cp_done, cp_failures, cp_skipped = cp_check.run(CP_BUDGET_S, Path(tmp), torch.cuda.device_count())
    print()
    print("\n".join(table(done)))
    agreement = fsdp_agreement(done)
    if agreement is not None:
        print(agreement[0])
        if not agreement[1]:
            failures.append(("Megatron-FSDP vs distributed optimizer", agreement[0]))
    cp_lines, disagreements = cp_check.table(cp_done)
    failures += cp_failures + disagreements
    print("\n".join(["", *cp_lines, f"THD partition = Transformer Engine's: {cp_check.partition_matches_te()}"]))
    for label, why in cp_skipped:
        print(f"{label:<44} skipped ({why})")
    for label in skipped:
        print(f"{label:<44} skipped{'' if '(refused' in label else ' (time budget)'}")
    for label, why in failures:
        print(f"{label:<44} FAILED: {why}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                   "cases": {c.label: c.result for c in done},
                                                   "context_parallel": {c.label: c.losses for c in cp_done}},
                                                  indent=1))
    print(f"total {time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
