"""GPU-only wiring (skipped without CUDA): the Transformer Engine spec, FP8 and context parallelism train.

On a CUDA machine with transformer-engine installed these run the real trainer in one process; the numbers
they compare are the bf16 local-spec run against the TE spec and FP8 runs of the same model and data.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
BASE = ["model.seq_length=256", "train.steps=4", "train.precision=bf16", "logging.tensorboard=false",
        "checkpoint.save_at_end=false", "checkpoint.interval=null"]


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


@contextlib.contextmanager
def built_chunk(config: str, overrides: list[str]):
    """The model chunk the trainer builds for `config` on this GPU (one process, world 1)."""
    from model_providers.core.builder import build_model
    from model_providers.core.model_plan import model_plan
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.run.runtime import init_distributed, init_model_parallel, shutdown

    cfg = load_config(config, overrides)
    init_distributed()
    try:
        layout = derive_layout(cfg, 1, vocab_size=32000, on_gpu=True)
        init_model_parallel(layout, cfg.train.seed)
        yield build_model(model_plan(cfg), layout)[0]
    finally:
        shutdown()


def _train(tmp_path: Path, name: str, extra: list[str], nproc: int = 1, config: str = "tiny_llama",
           base: list[str] = BASE) -> list[float]:
    run_dir = tmp_path / name
    launcher = [sys.executable, "-m", "pretrain"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "pretrain"]
    proc = subprocess.run([*launcher, "train", config, *base, *extra, f"run.dir={run_dir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run_dir / "train.log").write_text(proc.stdout + proc.stderr)
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_local_spec_bf16_trains(tmp_path):
    losses = _train(tmp_path, "local", ["model.transformer_impl=local"])
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not _te_available(), reason="transformer-engine not installed")
def test_te_spec_matches_local_spec_and_fp8_trains(tmp_path):
    local = _train(tmp_path, "local", ["model.transformer_impl=local"])
    te = _train(tmp_path, "te", ["model.transformer_impl=transformer_engine"])
    # Same weights (layout-invariant init by global name), different kernels: bf16-level agreement.
    assert abs(te[0] - local[0]) / local[0] < 2e-2, (te, local)
    fp8 = _train(tmp_path, "fp8", ["model.transformer_impl=transformer_engine", "model.fp8=tensorwise"])
    assert all(x == x for x in fp8) and abs(fp8[0] - te[0]) / te[0] < 5e-2, (fp8, te)


@pytest.mark.skipif(not _te_available() or torch.cuda.device_count() < 2, reason="needs TE and 2 GPUs")
def test_context_parallel_matches_one_gpu(tmp_path):
    one = _train(tmp_path, "cp1", ["model.transformer_impl=transformer_engine"])
    two = _train(tmp_path, "cp2", ["model.transformer_impl=transformer_engine", "parallel.context=2"], nproc=2)
    assert abs(two[0] - one[0]) / one[0] < 2e-2, (two, one)


# --- Long-run operations (issue 15): on a GPU these run the paths the CPU suite cannot. ---------------------------

NO_CKPT = ["checkpoint.interval=null", "checkpoint.save_at_end=false", "train.exit_signal_handler=false"]


def test_megatron_fsdp_matches_distributed_optimizer(tmp_path):
    """optimizer.fsdp=true (Megatron-FSDP) trains to the distributed optimizer's losses (fp32, ≤ 1e-5 relative)."""
    nproc = min(2, torch.cuda.device_count())
    common = ["train.precision=fp32", "model.transformer_impl=local", *NO_CKPT]
    distopt = _train(tmp_path, "distopt", common + ["optimizer.distributed=true"], nproc=nproc)
    fsdp = _train(tmp_path, "fsdp", common + ["optimizer.fsdp=true"], nproc=nproc)
    rel = max(abs(a - b) / abs(b) for a, b in zip(fsdp, distopt))
    print(f"Megatron-FSDP (DP{nproc}) {fsdp} vs distributed optimizer {distopt}: max rel {rel:.1e}")
    assert rel <= 1e-5, (fsdp, distopt)


def test_document_mask_local_spec_on_gpu(tmp_path):
    """The per-document mask on GPU (local spec, fused causal softmax off): packed loss = weighted document mean."""
    from tests.pretrain.doc_helpers import FLAGS, case, documents, weighted_mean

    def overrides(data_prefix: str, seq: int, extra: list[str]) -> list[str]:
        one = case(tmp_path / "unused", data_prefix, seq,
                   [*extra, "train.precision=fp32", "model.transformer_impl=local"])
        return [o for o in one["overrides"] if not o.startswith("run.dir=")]  # _train sets run.dir

    packed, seq, singles = documents(tmp_path)
    per_doc = {name: (_train(tmp_path, f"doc_{name}", overrides(path, n, []))[0], n)
               for name, (path, n) in singles.items()}
    got = _train(tmp_path, "packed", overrides(packed, seq, FLAGS))[0]
    expected = weighted_mean(per_doc)
    assert abs(got - expected) / got < 1e-5, (got, expected)


def test_profile_window_on_gpu_has_cuda_kernels(tmp_path):
    """logging.profile on GPU: the Chrome trace holds CUDA kernels inside the step ranges (NVTX ranges go to nsys)."""
    _train(tmp_path, "prof", ["logging.profile.start_step=2", "logging.profile.end_step=3"])
    trace = json.loads((tmp_path / "prof" / "profile" / "rank0_steps2-3.json").read_text())
    cats = {e.get("cat") for e in trace["traceEvents"]}
    assert "kernel" in cats, sorted(c for c in cats if c)


@pytest.mark.skipif(not _te_available(), reason="transformer-engine not installed")
def test_layernorm_recompute_with_te_installed(tmp_path):
    """Selective recompute of the norms (local spec, where it applies) trains to the same losses on GPU."""
    base = _train(tmp_path, "norec", ["model.transformer_impl=local", "train.precision=fp32"])
    rec = _train(tmp_path, "rec", ["model.transformer_impl=local", "train.precision=fp32",
                                   "model.recompute_granularity=selective",
                                   "model.recompute_modules=[core_attn,mlp,layernorm]"])
    assert max(abs(a - b) / abs(b) for a, b in zip(rec, base)) < 1e-6, (rec, base)


MOE = ["model.seq_length=256", "train.precision=bf16", "logging.tensorboard=false", "checkpoint.interval=null"]


@pytest.mark.skipif(not _te_available(), reason="transformer-engine not installed")
def test_moe_grouped_gemm_matches_sequential_experts_and_checkpoints_move_between_them(tmp_path):
    """tiny_moe on one GPU (EP on one GPU is EP1): Transformer Engine grouped-GEMM experts (`moe_grouped_gemm`
    resolves to true with the TE spec) against the local spec's experts run one after another, from the same
    layout-invariant weights; then a grouped-GEMM checkpoint resumes with sequential experts (same keys)."""
    steps = ["train.steps=2", "checkpoint.save_at_end=true"]
    te = _train(tmp_path, "moe_te", ["model.transformer_impl=transformer_engine", *steps], config="tiny_moe",
                base=MOE)
    local = _train(tmp_path, "moe_local", ["model.transformer_impl=local", *steps], config="tiny_moe", base=MOE)
    assert abs(te[0] - local[0]) / local[0] < 2e-2, (te, local)
    record = json.loads((tmp_path / "moe_te" / "metrics.jsonl").read_text().splitlines()[0])
    assert sum(record["moe_tokens_per_expert"][0]) == 8 * 256 * 2 and record["moe_load_balancing_loss"] > 0

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    with built_chunk("tiny_moe", ["model.transformer_impl=transformer_engine", *MOE]) as chunk:
        assert isinstance(chunk.decoder.layers[0].mlp.experts, TEGroupedMLP)

    resumed = _train(tmp_path, "moe_te", ["model.transformer_impl=local", "train.steps=4"], config="tiny_moe",
                     base=MOE)
    assert "resumed from" in (tmp_path / "moe_te" / "train.log").read_text()
    assert len(resumed) == 4 and all(x == x for x in resumed), resumed


DEEPSEEK = ["model.seq_length=256", "train.precision=bf16", "logging.tensorboard=false", "checkpoint.interval=null"]


@pytest.mark.skipif(not _te_available(), reason="transformer-engine not installed")
def test_deepseek_te_spec_matches_local_spec_and_checkpoints_move_between_them(tmp_path):
    """tiny_deepseek on one GPU: MLA through Transformer Engine (fused latent norms, duplicated down-projections,
    TE attention with different query/value head widths, fused YaRN RoPE), grouped-GEMM experts, MTP; against the
    local spec from the same layout-invariant weights (checkpoint keys are shared: a TE checkpoint resumes on the
    local spec); FP8 with TE's blockwise recipe trains when TE (>= 2.3) and the GPU (compute capability >= 9.0)
    offer it."""
    steps = ["train.steps=2", "checkpoint.save_at_end=true"]
    te = _train(tmp_path, "ds_te", ["model.transformer_impl=transformer_engine", *steps], config="tiny_deepseek",
                base=DEEPSEEK)
    local = _train(tmp_path, "ds_local", ["model.transformer_impl=local", *steps], config="tiny_deepseek",
                   base=DEEPSEEK)
    assert abs(te[0] - local[0]) / local[0] < 2e-2, (te, local)
    record = json.loads((tmp_path / "ds_te" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["mtp_loss"] > 0 and record["moe_expert_bias"][0] is None and record["moe_expert_bias_range"] > 0

    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    with built_chunk("tiny_deepseek", ["model.transformer_impl=transformer_engine", *DEEPSEEK]) as chunk:
        assert isinstance(chunk.decoder.layers[0].self_attention, MLASelfAttention)
        assert isinstance(chunk.decoder.layers[1].mlp.experts, TEGroupedMLP) and chunk.mtp is not None

    resumed = _train(tmp_path, "ds_te", ["model.transformer_impl=local", "train.steps=4"], config="tiny_deepseek",
                     base=DEEPSEEK)
    assert "resumed from" in (tmp_path / "ds_te" / "train.log").read_text()
    assert len(resumed) == 4 and all(x == x for x in resumed), resumed

    import transformer_engine

    from pretrain.rules.mla import te_block_scaling_support

    version = tuple(int(x) for x in transformer_engine.__version__.split(".")[:2] if x.isdigit())
    blockwise = ["model.transformer_impl=transformer_engine", "model.fp8_recipe=blockwise", "train.steps=2"]
    if version >= (2, 3) and te_block_scaling_support()[0]:
        fp8 = _train(tmp_path, "ds_fp8", blockwise, config="tiny_deepseek", base=DEEPSEEK)
        assert all(x == x for x in fp8) and abs(fp8[0] - local[0]) / local[0] < 5e-2, (fp8, local)
    else:  # refused before training, naming the cause
        from pretrain.config import load_config
        from pretrain.validate import validate

        report = validate(load_config("tiny_deepseek", [*DEEPSEEK, *blockwise]), 1, te_on_gpu=True,
                          cuda_available=True, files=False)
        assert any("model.fp8=blockwise" in str(e) for e in report.errors), report.text()
