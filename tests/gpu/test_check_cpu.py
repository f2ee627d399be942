"""The GPU check's wiring, on any machine: run.sh's answer without a GPU and with a broken torch or megatron-core,
the dry run's cases and plans, and the Megatron-Core baseline loop's calls (on CPU, tiny shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_run_sh_without_a_gpu_says_so_and_exits_0():
    done = subprocess.run(["bash", str(REPO / "tests/gpu/run.sh")], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU here" in done.stdout and "nothing to check" in done.stdout


BROKEN = {  # a package that shadows the real one on PYTHONPATH and fails as a broken install does
    "torch": ("torch/__init__.py", "import torch failed: ImportError: libcudart.so.12: cannot open shared object"),
    "megatron": ("megatron/core/__init__.py", "import megatron.core failed: ImportError: libcudart.so.12: cannot open"),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_run_sh_with_a_broken_install_says_what_failed_and_exits_1(tmp_path, broken):
    """A torch or megatron-core that fails to import is not "no GPU": run.sh shows the error and fails."""
    path, shown = BROKEN[broken]
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / broken / "__init__.py").touch()
    (tmp_path / path).write_text('raise ImportError("libcudart.so.12: cannot open shared object file")\n')
    done = subprocess.run(["bash", str(REPO / "tests/gpu/run.sh")], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no CUDA GPU" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tests/gpu/run.sh: the GPU check cannot run with "), done.stderr
    assert shown in lines[0] and f"{tmp_path / path}:1" in lines[0], lines[0]


def test_gpus_torch_cannot_use_are_a_failure():
    """NVIDIA devices present but torch.cuda.is_available() False (a CPU build of torch, a refused driver): exit 1
    with the reason; no device at all: the "no CUDA GPU here" answer, exit 0; a usable GPU: the check goes on."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import preflight

    status, line = preflight.cuda_verdict(False, "2.13.0+cpu", None, ["nvidia0", "nvidia1"], [])
    assert status == 1 and "NVIDIA devices (nvidia0, nvidia1) but torch 2.13.0+cpu (a CPU-only build" in line
    status, line = preflight.cuda_verdict(False, "2.13.0", "12.8", ["nvidia0"],
                                          ["CUDA initialization: The NVIDIA driver on your system is too old"])
    assert status == 1 and "(CUDA 12.8 build)" in line and "driver on your system is too old" in line
    assert preflight.cuda_verdict(False, "2.13.0", "12.8", [], [])[0] == 0
    assert preflight.cuda_verdict(True, "2.13.0", "12.8", ["nvidia0"], []) == (None, "")
    assert preflight.nvidia_devices(REPO) == []


def test_dry_run_lists_every_case_with_its_plan():
    done = subprocess.run(["bash", str(REPO / "tests/gpu/run.sh"), "--dry-run"], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    cases = [line for line in done.stdout.splitlines() if " plan " in line]
    # 3 specs x (8B trainer, 8B Megatron-Core loop, 70B with the meter), the Megatron-FSDP / distributed optimizer
    # pair, then MoE at 30B-A3B width (local, TE), then the DeepSeek-V3 class (MLA, MTP) at 16B-A3B width (local, TE)
    assert len(cases) == 15, done.stdout
    assert sum("Megatron-Core loop" in c for c in cases) == 3
    assert [c.split(" plan ")[0].strip() for c in cases[-6:-4]] == [
        "8B width 2 layers fp32, distributed optimizer", "8B width 2 layers fp32, Megatron-FSDP"]
    assert "optimizer.fsdp=true" in done.stdout
    assert [c.split(" plan ")[0].strip() for c in cases[-4:]] == [
        "30B-A3B MoE width, local bf16", "30B-A3B MoE width, TE bf16", "16B-A3B MLA width, local bf16",
        "16B-A3B MLA width, TE bf16"]
    assert "tests/gpu/mcore_loop.py" in done.stdout and "--meter" in done.stdout


def test_megatron_core_baseline_loop_trains_on_cpu(tmp_path):
    out = tmp_path / "loop.json"
    done = subprocess.run([sys.executable, str(REPO / "tests/gpu/mcore_loop.py"), "--cpu", "--layers", "2",
                           "--hidden", "64", "--ffn", "176", "--heads", "4", "--groups", "2", "--vocab", "4096",
                           "--seq", "64", "--microbatches", "2", "--steps", "3", "--warmup", "1", "--json-out",
                           str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["loss_last"] < result["loss_first"] and result["tokens_per_s_per_gpu"] > 0


def test_fsdp_agreement_is_judged_on_every_step():
    """The GPU check's verdict on the Megatron-FSDP / distributed-optimizer pair (no GPU needed)."""
    sys.path.insert(0, str(REPO / "tests/gpu"))
    import check

    def case(name: str, losses: list[float]):
        c = next(c for c in check.cases(False, None) if c.label == f"8B width 2 layers fp32, {name}")
        c.result = {"losses": losses}
        return c

    same = [case("distributed optimizer", [10.0, 9.0]), case("Megatron-FSDP", [10.0, 9.00000001])]
    line, ok = check.fsdp_agreement(same)
    assert ok and "max relative loss difference 1.1e-09" in line
    off = [case("distributed optimizer", [10.0, 9.0]), case("Megatron-FSDP", [10.0, 9.1])]
    assert check.fsdp_agreement(off)[1] is False
    assert check.fsdp_agreement(same[:1]) is None


def test_cases_the_validator_refuses_are_skipped_with_the_reason():
    sys.path.insert(0, str(REPO / "tests/gpu"))
    import check

    from pretrain.compat.mcore import megatron_fsdp_limits

    fsdp = next(c for c in check.cases(False, None) if c.label.endswith("Megatron-FSDP"))
    distopt = next(c for c in check.cases(False, None) if c.label.endswith("distributed optimizer"))
    assert check.refusal(distopt) is None
    refused = check.refusal(fsdp)
    if megatron_fsdp_limits["dp1"] == "right":
        assert refused is None
    else:
        assert refused.startswith("[optimizer.fsdp] Megatron-FSDP with one data-parallel rank gives wrong gradients")
def test_context_parallel_part_is_wired():
    """`--only cp --dry-run` lists the CP agreement runs (CPU reference, TE CP1 / CP2 p2p / CP2 a2a, causal and
    packed documents); without GPUs the TE runs are skipped with the reason, and the table flags a TE loss that
    strays from the CPU attention's."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import cp_check

    done = subprocess.run(["bash", str(REPO / "tests/gpu/run.sh"), "--dry-run", "--only", "cp"], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    runs = [c.label for c in cp_check.cases()]
    assert len(runs) == 8 and all(label in done.stdout for label in runs)
    assert "parallel.cp_comm_type=a2a" in done.stdout and "data.reset_attention_mask=true" in done.stdout
    ran, failures, skipped = cp_check.run(0.0, REPO, gpus=0)
    assert ran == [] and failures == []
    reasons = dict(skipped)
    assert reasons["CP2 p2p TE bf16, causal"] == "needs 2 GPUs, 0 here"
    assert reasons["CP2 p2p CPU attention fp32, causal"] == "time budget"
    ref, te, off = cp_check.cases()[0], cp_check.cases()[2], cp_check.cases()[3]
    ref.losses, te.losses, off.losses = [10.0, 9.0, 8.0], [10.05, 9.0, 8.1], [10.0, 9.5, 8.0]
    lines, bad = cp_check.table([ref, te, off])
    assert "reference" in lines[1] and f"{0.1 / 8:.2e}" in lines[2]
    assert [label for label, _ in bad] == [off.label]


def test_every_name_the_gpu_files_import_exists_here():
    """tests/gpu runs only where a GPU is, so a name it imports inside a function (a helper moved or renamed on the
    CPU side) would fail there first: each `from M import a, b` in tests/gpu/*.py resolves here, Transformer
    Engine's modules aside (not installed on CPU)."""
    import ast
    import importlib

    missing = []
    for path in sorted((REPO / "tests" / "gpu").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module.startswith("transformer_engine"):
                continue
            if node.module in {"cp_check", "preflight"}:  # tests/gpu's own modules, imported by path
                module = importlib.import_module(f"tests.gpu.{node.module}")
            else:
                module = importlib.import_module(node.module)
            missing += [f"{path.name}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                        if a.name != "*" and not hasattr(module, a.name)
                        and not (hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{a.name}"))]
    assert not missing, missing
