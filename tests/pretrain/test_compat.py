"""The compatibility layer: installed versions against the supported matrix, and what start-up applies."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from pretrain.compat.matrix import Installed, assess
from pretrain.config import load_config
from pretrain.validate import validate
from tests.cli import run_cli

pytestmark = pytest.mark.mcore

REPO = Path(__file__).resolve().parents[2]
ENV_CMD = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "NO_VCS_VERSION": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, **ENV_CMD}, capture_output=True,
                          text=True, timeout=300)


def test_validate_reports_installed_versions():
    done = run_cli("pretrain", ["validate", "tiny_llama", "data.mock=true"], env=ENV_CMD, cwd=REPO)
    assert done.rc == 0, done.stderr
    py = ".".join(str(x) for x in sys.version_info[:3])
    line = (f"note: versions: Python {py}, megatron-core {metadata.version('megatron-core')}, Transformer Engine "
            f"none, torch {metadata.version('torch')} (tested in CI)")
    assert line in done.stdout, done.stdout


def test_startup_applies_what_the_release_needs():
    """Start-up applies a Megatron fix exactly where the installed Megatron-Core shows its need before anything is
    patched (`compat_probe.py`: a name defined only with TE, a TE placeholder class, a signature without
    k_channels, torch's Adam inside the distributed optimizer, ...), and on CPU every CPU shim."""
    from pretrain.compat.cpu_shims import SHIMS
    from pretrain.compat.fsdp_cpu import FSDP_SHIMS
    from pretrain.compat.megatron_fixes import FIXES

    done = _run("tests/pretrain/compat_probe.py")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    need, applied = got["need"], got["applied"]
    assert sorted(need) == sorted(f.name for f in FIXES), "every Megatron fix needs a probe in compat_probe.py"
    print(f"megatron-core {metadata.version('megatron-core')}: needed {[n for n in need if need[n]]}")
    assert [n for n in applied if not n.startswith("cpu:")] == [f.name for f in FIXES if need[f.name]]
    assert [n for n in applied if n.startswith("cpu:")] == [f"cpu:{s.name}" for s in (*SHIMS, *FSDP_SHIMS)]


def test_grad_norm_does_not_depend_on_how_the_gradients_are_split():
    """Megatron's l2 norm without apex, as the optimizer calls it, on one 2M-element fp32 gradient and on its halves
    (what TP2 or an FSDP shard holds): fp32 accumulation differs by > 1e-6 relative; the CPU shim by < 1e-7."""
    import torch
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    from pretrain import compat

    grad = torch.randn(1 << 21, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = float(grad.double().norm())

    def rel(impl, tensors):
        return abs(float(clip_grads.multi_tensor_applier(impl, None, [tensors], False)[0]) - exact) / exact

    assert "cpu:fp64_grad_norm" in compat.apply()
    assert clip_grads.l2_norm_impl is not local_multi_tensor_l2_norm
    assert rel(local_multi_tensor_l2_norm, [grad]) > 1e-6  # what it works around
    for pieces in ([grad], list(grad.chunk(2)), list(grad.chunk(4))):
        assert rel(clip_grads.l2_norm_impl, pieces) < 1e-7


@pytest.mark.parametrize("installed,level,reason", [
    (Installed("3.11.7", "0.16.1", None, "2.13.0+cpu"), "tested", None),
    (Installed("3.11.7", "0.19.2", None, "2.13.0+cpu"), "tested",
     "megatron-core 0.19.2 declares Python >= 3.12; on Python 3.11 it runs as a test configuration only"),
    (Installed("3.12.3", "0.18.2", "2.16.0", "2.8.0"), "untested", "this combination is not run by CI"),
    (Installed("3.12.3", "0.19.2", "2.18.0", "2.13.0"), "untested",
     "Transformer Engine 2.18.0 is newer than the pairing (megatron-core 0.19.x pairs with Transformer Engine "
     ">=2.17,<2.18)"),
    (Installed("3.12.3", "0.19.2", "2.12.0", "2.13.0"), "refused",
     "Transformer Engine 2.12.0: megatron-core 0.19.x pairs with Transformer Engine >=2.17,<2.18"),
    (Installed("3.12.3", "0.16.1", "2.14.1", "2.9.0"), "refused",
     "Transformer Engine 2.14.1: megatron-core 0.16.x pairs with Transformer Engine >=2.9,<2.12"),
    (Installed("3.12.3", "0.20.0", None, "2.13.0"), "refused",
     "megatron-core 0.20.0 is outside the supported range >=0.16.1,<0.20"),
    (Installed("3.12.3", "0.15.2", None, "2.13.0"), "refused",
     "megatron-core 0.15.2 is outside the supported range >=0.16.1,<0.20"),
    (Installed("3.10.12", "0.19.2", None, "2.13.0"), "refused",
     "megatron-core 0.19.2 needs Python >= 3.12, found 3.10.12"),
    (Installed("3.12.3", "0.19.2", None, "2.5.1"), "refused", "torch 2.5.1: megatron-core needs torch >= 2.6"),
])
def test_matrix(installed, level, reason):
    got_level, reasons = assess(installed)
    assert got_level == level, reasons
    if reason is None:
        assert reasons == []
    else:
        assert any(r.startswith(reason) for r in reasons), reasons


def test_refusal_is_one_clear_error_unless_allowed():
    cfg = load_config("tiny_llama", ["data.mock=true"])
    newer = Installed("3.12.3", "0.20.1", "2.17.1", "2.13.0")
    report = validate(cfg, 1, versions=newer)
    assert [str(p) for p in report.errors] == [
        "[run.allow_untested_versions] unsupported versions: megatron-core 0.20.1 is outside the supported range "
        ">=0.16.1,<0.20. Fix: install a supported combination (docs/compatibility.md), or set "
        "run.allow_untested_versions=true to run anyway"]
    cfg = load_config("tiny_llama", ["data.mock=true", "run.allow_untested_versions=true"])
    report = validate(cfg, 1, versions=newer)
    assert report.ok
    assert ("versions: Python 3.12.3, megatron-core 0.20.1, Transformer Engine 2.17.1, torch 2.13.0 "
            "(outside the supported matrix)") in report.notes
    assert "warning: running outside the supported matrix (run.allow_untested_versions=true)" in report.notes


def test_installing_the_project_keeps_the_installed_megatron_core(tmp_path):
    """`pip install -e .` in an environment that already has a supported megatron-core (a container's, or
    the 0.19.2 venv) installs nothing but the project: the release stays."""
    report = tmp_path / "report.json"
    done = _run("-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check", "--report",
                str(report), "-e", str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    planned = {item["metadata"]["name"]: item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert "megatron-core" not in planned and "torch" not in planned, planned
    assert "megapretrain" in planned, planned


GRAD_NORM = """
import json, torch, torch.distributed as dist
from pretrain import compat
from pretrain.compat.cpu_shims import switched_off
from pretrain.run.runtime import init_distributed
compat.apply()
init_distributed()
from megatron.core import parallel_state as ps
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
ps.initialize_model_parallel()
g = torch.randn(32000 * 128, generator=torch.Generator().manual_seed(0))  # an output layer's worth
exact = float(g.double().norm())
norm = lambda: get_grad_norm_fp32([g], grad_stats_parallel_group=ps.get_model_parallel_group())
shimmed = norm()
with switched_off("fp64_grad_norm"):
    plain = norm()
print(json.dumps([abs(shimmed - exact) / exact, abs(plain - exact) / exact]))
dist.destroy_process_group()
"""


def test_grad_norm_of_fp32_gradients_is_exact_on_cpu():
    """Megatron-Core's gradient norm without apex/TE (`local_multi_tensor_l2_norm`) loses ~1e-4 on a 4-million-value
    fp32 gradient on CPU; the `fp64_grad_norm` CPU shim sums the squares in fp64."""
    done = _run("-c", GRAD_NORM)
    assert done.returncode == 0, done.stderr[-3000:]
    shimmed, plain = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"relative error of the grad norm: {shimmed:.1e} with the shim, {plain:.1e} without")
    assert shimmed < 1e-7 < 1e-6 < plain


_DEFERRED_PROBE = """
import json, sys
from pretrain import compat
compat.apply(on_gpu=False)
at_start = [n for n in ("transformers", "wandb") if n in sys.modules]
from megatron.core import timers
from megatron.core.tokenizers.text.libraries import chat_template, huggingface_tokenizer
flags = [huggingface_tokenizer.HAVE_TRANSFORMERS, chat_template.HAVE_TRANSFORMERS]
import transformers, wandb
from transformers.utils.chat_template_utils import _compile_jinja_template
two = "{{ 1 + 1 }}"
same = [huggingface_tokenizer.AutoTokenizer.from_pretrained == transformers.AutoTokenizer.from_pretrained,
        chat_template._compile_jinja_template(two).render() == _compile_jinja_template(two).render(),
        timers.wandb.init is wandb.init]
print(json.dumps({"at_start": at_start, "flags": flags, "same": same}))
"""


def test_optional_imports_are_deferred_to_first_use():
    """A CPU process's start-up imports neither transformers nor wandb (megatron.core's optional imports of them are
    stand-ins), and Megatron's modules then see both as installed and reach the real objects."""
    done = _run("-c", _DEFERRED_PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"at_start": [], "flags": [True, True], "same": [True, True, True]}, got
