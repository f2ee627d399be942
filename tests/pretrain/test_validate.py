"""Pre-flight validation: each rule's exact message, all problems at once, exit code 2 from the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pretrain.config import CONFIG_DIR, load_config
from pretrain.validate import validate
from tests.cli import run_cli

REPO = CONFIG_DIR.parent.parent


def problems(overrides: list[str], world: int, config: str = "tiny_llama", **kw) -> list[str]:
    report = validate(load_config(config, overrides), world, **kw)
    return [str(p) for p in report.errors]


CASES = [
    (["parallel.tensor=2"], 3,
     "[parallel.tensor, parallel.pipeline, parallel.context] world size 3 is not divisible by tensor×pipeline×context "
     "= 2×1×1 = 2. Fix: launch a multiple of 2 processes, or choose sizes whose product divides 3"),
    (["parallel.pipeline=3"], 3,
     "[model.num_layers, parallel.pipeline] model.num_layers=4 is not divisible by pipeline stages 3 = 3. "
     "Fix: choose a stage count dividing 4 (1, 2, 4), or uneven stages (parallel.num_layers_in_first_pipeline_stage / "
     "..._last_...), the embedding / loss counted as layers (parallel.account_for_embedding_in_pipeline_split / "
     "..._loss_...) or any placement (parallel.pipeline_layout, Megatron-Core's pipeline_model_parallel_layout)"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=4"], 2,
     "[model.num_layers, parallel.pipeline, parallel.virtual_pipeline] model.num_layers=4 is not divisible by "
     "pipeline stages 2×4 = 8. Fix: choose a stage count dividing 4 (1, 2, 4), or uneven stages "
     "(parallel.num_layers_in_first_pipeline_stage / ..._last_...), the embedding / loss counted as layers "
     "(parallel.account_for_embedding_in_pipeline_split / ..._loss_...) or any placement (parallel.pipeline_layout, "
     "Megatron-Core's pipeline_model_parallel_layout)"),
    (["parallel.virtual_pipeline=2"], 1,
     "[parallel.virtual_pipeline, parallel.pipeline] interleaving (parallel.virtual_pipeline=2) needs "
     "parallel.pipeline > 1. Fix: set parallel.pipeline >= 2 or parallel.virtual_pipeline=null"),
    (["model.num_query_groups=2", "parallel.tensor=4"], 4,
     "[model.num_query_groups, parallel.tensor] model.num_query_groups=2 is not divisible by parallel.tensor=4. "
     "Fix: choose parallel.tensor from 1, 2"),
    (["model.num_attention_heads=6", "model.num_query_groups=3", "model.hidden_size=132", "parallel.tensor=4"], 4,
     "[model.num_attention_heads, parallel.tensor] model.num_attention_heads=6 is not divisible by "
     "parallel.tensor=4. Fix: choose parallel.tensor from 1, 2, 3, 6"),
    (["model.num_query_groups=3"], 1,
     "[model.num_attention_heads, model.num_query_groups] model.num_attention_heads=8 is not divisible by "
     "model.num_query_groups=3. Fix: choose num_query_groups from 1, 2, 4, 8"),
    (["parallel.sequence_parallel=true"], 1,
     "[parallel.sequence_parallel, parallel.tensor] parallel.sequence_parallel=true needs parallel.tensor > 1. "
     "Fix: set parallel.sequence_parallel=false or parallel.tensor >= 2"),
    (["parallel.tensor=2", "parallel.sequence_parallel=true", "model.seq_length=127"], 2,
     "[model.seq_length, parallel.tensor, parallel.sequence_parallel] model.seq_length=127 is not divisible by "
     "parallel.tensor=2 (sequence parallel splits the sequence across TP ranks). Fix: use a sequence length that "
     "is a multiple of 2"),
    (["train.global_batch_size=6"], 2,
     "[train.global_batch_size, train.micro_batch_size] train.global_batch_size=6 is not divisible by "
     "micro_batch_size×data_parallel = 2×2 = 4. Fix: use a global batch that is a multiple of 4"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2", "train.global_batch_size=6"], 2,
     "[train.global_batch_size, parallel.pipeline, parallel.virtual_pipeline] interleaved pipelining needs the "
     "number of microbatches (3) to be divisible by parallel.pipeline=2. Fix: use train.global_batch_size a "
     "multiple of 4"),
    (["model.fp8=tensorwise"], 1,
     "[model.fp8] FP8 needs Transformer Engine on a GPU. Fix: set model.fp8=null on this machine"),
    (["optimizer.overlap_param_gather=true", "optimizer.overlap_grad_reduce=true"], 1,
     "[optimizer.overlap_param_gather, optimizer.distributed] optimizer.overlap_param_gather needs the distributed "
     "optimizer. Fix: set optimizer.distributed=true"),
    (["data.mock=false"], 1,
     "[data.blend, data.mock] no training data: data.blend and data.train_blend are empty and data.mock is false. "
     "Fix: set data.blend=[PREFIX] (from `python -m data_tools preprocess`) or data.mock=true"),
    (["model.recompute_granularity=full"], 1,
     "[model.recompute_granularity, model.recompute_method] full recompute needs model.recompute_method uniform "
     "or block. Fix: set model.recompute_method=uniform (and model.recompute_num_layers)"),
    (["optimizer.decay_style=WSD"], 1,
     "[optimizer.decay_style, optimizer.wsd_decay_steps] WSD decay needs optimizer.wsd_decay_steps. Fix: set "
     "optimizer.wsd_decay_steps (e.g. 10% of train.steps)"),
    (["model.preset=tiny_mistral_swa", "model.window_attn_skip_freq=0"], 1,
     "[model.window_attn_skip_freq] model.window_attn_skip_freq=0 must be at least 1 (every N-th layer full). Fix: "
     "use e.g. 2 (alternating windowed and full layers) or null (all windowed)"),
    (["model.preset=tiny_gpt", "model.max_position_embeddings=64"], 1,
     "[model.seq_length, model.max_position_embeddings] model.seq_length=128 is longer than the learned position "
     "table (model.max_position_embeddings=64). Fix: set model.seq_length <= 64"),
    (["model.rope_scaling=true", "model.rope_scaling_high_freq_factor=1"], 1,
     "[model.rope_scaling_high_freq_factor, model.rope_scaling_low_freq_factor] RoPE scaling needs "
     "model.rope_scaling_high_freq_factor=1.0 above model.rope_scaling_low_freq_factor=1.0. Fix: use e.g. 4 (high) "
     "and 1 (low)"),
    (["model.vocab_size=512"], 1,  # tiny_llama trains on mock data: ids 1..4095 of the tokenizer
     "[model.vocab_size, data.mock, data.tokenizer_model] model.vocab_size=512 (model.preset=tiny_llama) is smaller "
     "than the tokenizer's vocabulary of 32,000 (the embedded Mistral-7B SentencePiece, as data.tokenizer_model is "
     "null), and mock data draws its ids up to 4,095 from it: token ids from 512 would have no embedding row. Fix: "
     "set model.vocab_size >= 32000 (or null: the tokenizer's), or name the model's own tokenizer in "
     "data.tokenizer_type/data.tokenizer_model"),
    (["model.vocab_size=4096", "data.mock=false"], 1,
     "[model.vocab_size, data.tokenizer_model] model.vocab_size=4,096 (model.preset=tiny_llama) is smaller than the "
     "tokenizer's vocabulary of 32,000 (the embedded Mistral-7B SentencePiece, as data.tokenizer_model is null): "
     "token ids 4,096 to 31,999 would have no embedding row. Fix: set model.vocab_size >= 32000 (or null: the "
     "tokenizer's), or name the model's own tokenizer in data.tokenizer_type/data.tokenizer_model"),
    (["model.sliding_window=0"], 1, "[model.sliding_window] model.sliding_window=0 must be at least 1. Fix: set "
     "model.sliding_window to 1 or more, or null (no window: full attention)"),
    # 1e-300 / 1e300 underflows to 0.0: the share is still said, in scientific notation
    (["data.blend=[1e-300, /d/a, 1e300, /d/b]"], 1, "[data.blend] data.blend weight 1e-300 of /d/a is 1e-600 of the "
     "total: that dataset would never be drawn (a share below 1e-12); use weights of comparable size, or remove the "
     "entry. Fix: write [prefix, ...] or [weight, prefix, weight, prefix, ...] with weights > 0, e.g. "
     "data.blend=[0.7,/d/a_text_document,0.3,/d/b_text_document]"),
    (["model.vocab_size=0"], 1, "[model.vocab_size] model.vocab_size=0 must be at least 1. Fix: set "
     "model.vocab_size to a positive integer, or null to derive it"),
    (["model.ffn_hidden_size=-1"], 1, "[model.ffn_hidden_size] model.ffn_hidden_size=-1 must be at least 1. Fix: "
     "set model.ffn_hidden_size to a positive integer, or null to derive it"),
]


@pytest.mark.parametrize("overrides,world,message", CASES, ids=[";".join(c[0]) for c in CASES])
def test_each_rule_reports_exact_message(overrides, world, message):
    got = problems(overrides, world)
    assert message in got, got


def test_mock_vocab_rule_knows_megatron_mock_ids():
    """The vocabulary rule's bound on mock ids is Megatron-Core's (`MockGPTLowLevelDataset`), and a vocabulary that
    covers them (the test suite's 4096 with the 32,000-token tokenizer) passes."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    from pretrain.data.vocab import MOCK_MAX_SEQUENCE

    assert MockGPTLowLevelDataset.max_sequence_length == MOCK_MAX_SEQUENCE
    assert not [p for p in problems(["model.vocab_size=4096"], 1) if "model.vocab_size" in p]


def test_context_parallel_runs_with_and_without_transformer_engine():
    # CPU: the local spec's CP attention (model_providers/core/cp_attention.py); GPU: Transformer Engine.
    assert problems(["parallel.context=2"], 2, te_on_gpu=False, cuda_available=False) == []
    assert problems(["parallel.context=2"], 2, te_on_gpu=True, cuda_available=True) == []
    assert problems(["model.fp8=tensorwise", "train.precision=bf16"], 1, te_on_gpu=True, cuda_available=True) == []


def test_param_gather_overlap_without_grad_reduce_overlap_is_valid():
    """Megatron-Core's DDP overlaps the parameter all-gather whether or not the gradient reduce-scatter is overlapped
    (Megatron-LM's argument check asks for both; Megatron-Bridge's DeepSeek-V3 H100 runs overlap the gather only), so
    it is not refused: 12 steps of tiny_llama on 2 ranks gave the same losses to the last digit with (gather, reduce)
    overlapped (on, on), (on, off) and (off, off); under Megatron-FSDP 6 steps gave the same losses with (on, on) and
    (on, off)."""
    gather_only = ["optimizer.overlap_grad_reduce=false", "optimizer.overlap_param_gather=true"]
    assert problems([*gather_only, "optimizer.distributed=true"], 2) == []
    assert problems([*gather_only, "optimizer.fsdp=true", "optimizer.distributed=false"], 2) == []


def test_all_problems_reported_at_once():
    got = problems(["parallel.tensor=3", "parallel.pipeline=3", "parallel.sequence_parallel=true",
                    "model.seq_length=100", "train.global_batch_size=7", "model.fp8=tensorwise"], 8)
    assert len(got) == 7, got
    assert got[0].startswith("[parallel.tensor, parallel.pipeline, parallel.context] world size 8")
    assert any(p.startswith("[model.num_layers, parallel.pipeline]") for p in got)
    assert any(p.startswith("[model.num_attention_heads, parallel.tensor]") for p in got)
    assert any(p.startswith("[model.num_query_groups, parallel.tensor]") for p in got)
    assert any(p.startswith("[model.ffn_hidden_size, parallel.tensor]") for p in got)
    assert any(p.startswith("[model.seq_length, parallel.tensor, parallel.sequence_parallel]") for p in got)
    assert any(p.startswith("[model.fp8]") for p in got)


def test_shipped_production_layouts_are_valid_on_their_clusters():
    # Layouts only: the data and tokenizer live on the cluster (files=False opens none of them).
    gpu = {"te_on_gpu": True, "cuda_available": True, "files": False}
    blend = ["data.blend=[/data/x_text_document]"]
    assert problems(blend, 64, config="llama3_70b", **gpu) == []
    assert problems(blend + ["model.fp8=tensorwise", "model.fp8_param_gather=true"], 64, "llama3_70b", **gpu) == []
    assert problems(blend, 8, config="llama3_8b", **gpu) == []
    assert problems([], 1) == [] and problems([], 2, config="tiny_gpt") == []  # these open their embedded files


def test_every_family_preset_is_valid_and_context_is_a_note():
    from model_providers import all_presets

    gpu = {"te_on_gpu": True, "cuda_available": True, "files": False}  # model rules; /d is not a dataset
    for name in all_presets():
        assert problems(["data.blend=[/d]", f"model.preset={name}"], 1, **gpu) == [], name
    report = validate(load_config("tiny_llama", ["model.preset=qwen3_8b", "model.seq_length=65536", "data.blend=[/d]"]),
                      1, te_on_gpu=True, cuda_available=True, files=False)
    assert report.ok and any("model.seq_length=65536 is beyond the model's context length "
                             "model.max_position_embeddings=40960" in n for n in report.notes)


def test_vocab_padding_is_reported_as_a_note():
    report = validate(load_config("llama3_70b", ["data.blend=[/d]"]), 64, te_on_gpu=True, cuda_available=True,
                      files=False)
    assert any("vocabulary 128256 is padded to 128512" in n for n in report.notes)


def test_cli_exit_codes_and_all_messages():
    ok = run_cli("pretrain", ["validate", "tiny_llama", "parallel.tensor=2", "--world-size", "4"], cwd=REPO)
    assert ok.rc == 0 and "config OK (world size 4)" in ok.stdout
    bad = run_cli("pretrain", ["validate", "tiny_llama", "parallel.pipeline=3", "train.global_batch_size=5",
                               "--world-size", "3"], cwd=REPO)
    assert bad.rc == 2
    assert "config check failed: 2 problem(s) (world size 3)" in bad.stderr
    assert "model.num_layers=4 is not divisible by pipeline stages 3 = 3" in bad.stderr
    assert "train.global_batch_size=5 is not divisible by micro_batch_size×data_parallel = 2×1 = 2" in bad.stderr


def test_trainer_refuses_invalid_config_before_starting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pretrain", "train", "tiny_llama", "parallel.sequence_parallel=true",
                           f"run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "parallel.sequence_parallel=true needs parallel.tensor > 1" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written
