"""The Megatron-FSDP runs the suite checks, in four launches (`tests/pretrain/conftest.py::fsdp_runs`).

- world 2, killed: ZeRO-3 at DP2 saves step 2, and is SIGKILLed while writing step 4 (its metrics are the
  FSDP DP2 reference);
- world 2: the killed run resumed in place in a fresh process; the distributed optimizer at DP2; ZeRO-2 (overlap:
  Megatron-FSDP forces it on, so every ZeRO-3 and ZeRO-2 run is an overlapped one); an FSDP run continuing a
  distributed-optimizer checkpoint and the reverse, a ZeRO-2 run continuing the ZeRO-3 one, a non-distributed
  optimizer refusing its optimizer state; an
  asynchronous save; an HF model imported, trained one step with FSDP at lr 0 (for the export); a planted pickle
  saved and a resume refusing it; each Megatron-FSDP CPU shim undone; tiny_moe at DP2 × EP2 with Megatron-FSDP
  (refused by validation where its grad norm is wrong) and with the distributed optimizer; tiny_moe with a dense
  first layer (layers keyed one by one in torch_dist) with the distributed optimizer, its weights continued by FSDP;
- world 1: one rank (the reference); FSDP at DP1 from the DP2 checkpoint where validation allows FSDP on one
  data-parallel rank; the single-process cases of test_megatron_fixes.py (`fix_cases.py`);
- world 4: TP2 without the `fsdp_tp_without_te` fix (fails where the fix is needed); TP2 × FSDP DP2; FSDP DP4
  from the DP2 checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tests.pretrain.ckpt_helpers import SMALL, command, log_text, run

STEPS = 4
BASE = SMALL + [f"train.steps={STEPS}", "checkpoint.save_at_end=false"]
NO_CKPT = ["checkpoint.interval=null", "train.exit_signal_handler=false"]
FSDP = ["optimizer.fsdp=true"]
ZERO2 = ["optimizer.fsdp=true", "optimizer.fsdp_sharding=optim_grads"]
MIXED = ["model.moe_layer_freq=[0,1,1,1]"]  # tiny_moe with a dense first layer
HF_FAMILY = "llama"  # tied embeddings: the shared weight goes through Megatron-FSDP too


def _case(name: str, root: Path, overrides: list[str], **extra) -> dict:
    return {"name": name, "overrides": [*BASE, *overrides, f"run.dir={root / name}"], **extra}


def world2_killed(root: Path) -> list[dict]:
    return [_case("killed", root, [*FSDP, "checkpoint.interval=2"], crash_in_save=STEPS)]


def world2(root: Path, hf_checkpoint: Path, hf_blend: str) -> list[dict]:
    from pretrain.compat.fsdp_cpu import FSDP_SHIMS

    hf = [f"checkpoint.pretrained={hf_checkpoint}", f"data.blend=[{hf_blend}]", "data.mock=false", *FSDP,
          "optimizer.lr=0", "optimizer.min_lr=0", "train.steps=1", "train.global_batch_size=2",
          "train.micro_batch_size=1", "logging.tensorboard=false", f"run.dir={root / 'hf_fsdp'}"]
    one_step = ["train.steps=1", *NO_CKPT]
    marker = str(root / "pwned_fsdp")
    return [
        # The planted pickle (test_megatron_fixes.py): saved, then a resume that must refuse it without running it.
        _case("evil_fsdp", root, [*FSDP, "train.steps=1", "checkpoint.save_at_end=true"], evil_rng=marker),
        _case("fsdp_refused", root, [*FSDP, "train.steps=2"], copy_from=[str(root / "evil_fsdp"), 1], marker=marker),
        *[_case(shim.name, root, [*FSDP, *one_step], without_shims=[shim.name]) for shim in FSDP_SHIMS],
        {"name": "hf_fsdp", "config": str(hf_checkpoint / "run_config.yaml"), "overrides": hf},
        {"name": "resumed", "overrides": [*BASE, *FSDP, "checkpoint.interval=2", f"run.dir={root / 'killed'}"]},
        _case("distopt", root, ["optimizer.distributed=true", "checkpoint.interval=2"]),
        # Overlap: Megatron-FSDP turns overlap_grad_reduce (ZeRO-2, ZeRO-3) and overlap_param_gather (ZeRO-3) on
        # itself (megatron_fsdp.py:276,279 / :330,333); runs with the flags set were bit-identical to these.
        _case("zero2", root, [*ZERO2, *NO_CKPT]),
        _case("fsdp_from_distopt", root, [*FSDP, "checkpoint.interval=2"], copy_from=[str(root / "distopt"), 2]),
        _case("distopt_from_fsdp", root, ["optimizer.distributed=true", "checkpoint.interval=2"],
              copy_from=[str(root / "killed"), 2]),
        # ZeRO-3's checkpoint continued with ZeRO-2 (optimizer.fsdp_sharding changed on resume), which saves step 4.
        _case("zero2_from_zero3", root, [*ZERO2, "checkpoint.interval=2"], copy_from=[str(root / "killed"), 2]),
        # Into the non-distributed optimizer the Adam state cannot cross: refused naming the way.
        _case("ddp_from_fsdp", root, ["checkpoint.interval=2"], copy_from=[str(root / "killed"), 2]),
        _case("async", root, [*FSDP, "checkpoint.interval=2", "checkpoint.async_save=true", "train.steps=2"]),
        # Layers of different kinds (a dense first layer, then MoE): Megatron-Core keys each layer on its own in
        # torch_dist; its weights cross into Megatron-FSDP (a chained MoE optimizer's state does not cross).
        {**_case("mixed_distopt", root, [*MIXED, "optimizer.distributed=true", "checkpoint.interval=2"]),
         "config": "tiny_moe"},
        {**_case("mixed_fsdp_from_distopt", root, [*MIXED, *FSDP, "checkpoint.load_optimizer=false", *NO_CKPT],
                 copy_from=[str(root / "mixed_distopt"), 2]), "config": "tiny_moe"},
        # FSDP × EP2: refused where Megatron-FSDP's grad norm is wrong with EP (validation), compared elsewhere.
        {**_case("moe_fsdp_ep2", root, [*FSDP, "parallel.expert=2", *NO_CKPT]), "config": "tiny_moe"},
    ] + ([{**_case("moe_distopt_ep2", root, ["optimizer.distributed=true", "parallel.expert=2", *NO_CKPT]),
           "config": "tiny_moe"}] if fsdp_with_ep() else [])


def fsdp_with_ep() -> bool:
    """Whether validation lets Megatron-FSDP run with expert parallelism on the installed release."""
    from pretrain.compat.mcore import megatron_fsdp_limits

    return megatron_fsdp_limits["ep_grad_norm"] == "right"


def world1(root: Path) -> list[dict]:
    """One rank, and the single-process cases of test_megatron_fixes.py (`fix_cases.py`, under root/fixes)."""
    from tests.pretrain.fix_cases import fix_cases

    cases = [_case("one_rank", root, NO_CKPT),
             *fix_cases(root / "fixes", root / "evil_fsdp" / "checkpoints" / "iter_0000001")]
    if fsdp_on_one_rank():  # refused by validation where Megatron-FSDP's gradients are wrong at DP1
        cases.append(_case("reshard_dp1", root, [*FSDP, "checkpoint.interval=2"], copy_from=[str(root / "async"), 2]))
    return cases


def world4(root: Path) -> list[dict]:
    return [_case("tp2_without_fix", root, [*FSDP, "parallel.tensor=2", "train.steps=1", *NO_CKPT],
                  without_fixes=["fsdp_tp_without_te"]),
            _case("tp2_fsdp_dp2", root, [*FSDP, "parallel.tensor=2", *NO_CKPT]),
            _case("reshard_dp4", root, [*FSDP, "checkpoint.interval=2"], copy_from=[str(root / "async"), 2])]


def fsdp_on_one_rank() -> bool:
    """Whether validation lets Megatron-FSDP run with one data-parallel rank on the installed release."""
    from pretrain.compat.mcore import megatron_fsdp_limits

    return megatron_fsdp_limits["dp1"] == "right"


# Native crashes of a rank seen on megatron-core 0.19.2 with Megatron-FSDP on CPU (not in our Python): glibc's abort
# on a corrupted heap, or a SIGSEGV (in the step after a save, 1 of 4 fresh-clone CI runs on 2026-12-04; in the first
# step after loading a distributed-optimizer checkpoint into Megatron-FSDP, one CI run on 2026-12-05). The class: a
# rank killed by SIGSEGV, SIGBUS or SIGABRT (torchrun's report, which the pool appends to the case's log) or glibc's
# heap-check messages. A Python error is never one of them: it ends the rank with a traceback and an exit status.
NATIVE_FLAKES = re.compile(r"Signal (?:6|7|11) \(SIG(?:ABRT|BUS|SEGV)\) received by PID \d+|"
                           r"(?:malloc|free|realloc)\(\): [a-z ]+|double free or corruption[^\n]*|"
                           r"corrupted (?:size vs\. prev_size|double-linked list)[^\n]*")


def _run_dirs(cases: list[dict]) -> list[Path]:
    return [Path(item.split("=", 1)[1]) for case in cases for item in case.get("overrides", [])
            if item.startswith("run.dir=")]


def launch(root: Path, world: int, cases: list[dict], timeout: float, tag: str = "") -> tuple[int, dict]:
    """ckpt_worker on `world` ranks; (exit code, results by case name). Cases may fail: the tests decide. A pool
    case (`tests.pool`), but the `_killed` plan (it SIGKILLs the trainer) is a launch of its own."""
    from tests.pool import run_case

    def once() -> int:
        if tag == "_killed":
            return run(command([], nproc=world, module="tests.pretrain.ckpt_worker", args=[str(plan)]), log,
                       timeout=timeout)
        try:
            return run_case(world, "tests.pretrain.ckpt_worker", [str(plan)], log, timeout=timeout)
        except AssertionError:  # the pool died (a rank aborted) or timed out: an exit status, as a launch gives
            return 1

    plan = root / f"plan{world}{tag}.json"
    results = root / f"results{world}{tag}.json"
    plan.write_text(json.dumps({"results": str(results), "cases": cases}))
    log = root / f"world{world}{tag}.log"
    # Run dirs an earlier launch wrote that this one continues in place ("resumed" saves into "killed"): kept as they
    # were, so that a rerun starts from what the first try started from.
    run_dirs = _run_dirs(cases)
    before = {d: d.with_name(d.name + ".before-launch") for d in run_dirs if d.exists()}
    for d, copy in before.items():
        shutil.copytree(d, copy, dirs_exist_ok=True)
    rc = once()
    flake = NATIVE_FLAKES.search(log_text(log)) if rc != 0 else None
    if flake:
        # A native crash (NATIVE_FLAKES), not our Python: the launch is rerun once from the run dirs as they were
        # before it, and said; a second crash fails the test.
        print(f"world {world}{tag}: {flake.group(0)!r} in a rank: launching again once")
        for d in run_dirs:
            shutil.rmtree(d, ignore_errors=True)
            if d in before:
                shutil.copytree(before[d], d)
        results.unlink(missing_ok=True)
        log.rename(log.with_suffix(".flake.log"))
        rc = once()
    for copy in before.values():
        shutil.rmtree(copy, ignore_errors=True)
    found = json.loads(results.read_text()) if results.exists() else {}
    if rc != 0 and not tag:
        raise AssertionError(log_text(log)[-4000:])
    return rc, found


def import_hf(root: Path) -> tuple[Path, Path, str]:
    """(HF model directory, its from-hf checkpoint, a blend tokenized with its tokenizer)."""
    from data_tools.convert import main as convert
    from data_tools.preprocess import preprocess
    from tests.data_tools.conftest import corpus_texts, write_jsonl
    from tests.data_tools.hf_families import SEQ_LENGTH, tokenizer_files, write_hf_model

    tokenizers = {k: tokenizer_files(k, root / "tokenizers" / k) for k in ("sentencepiece", "bpe")}
    src = write_hf_model(HF_FAMILY, root / "hf_src", tokenizers)
    ckpt = root / "hf_ckpt"
    assert convert(["from-hf", "--hf", str(src), "--output", str(ckpt), f"model.seq_length={SEQ_LENGTH[HF_FAMILY]}",
                    "--no-progress"]) == 0
    corpus = write_jsonl(root / "corpus.jsonl", corpus_texts(8))
    preprocess([str(corpus)], str(root / "hf_data"), "huggingface", str(src), append_eod=True, workers=1)
    return src, ckpt, f"{root / 'hf_data'}_text_document"
