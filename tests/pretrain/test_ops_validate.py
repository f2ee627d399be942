"""Rules for document boundaries, selective recompute modules, Megatron-FSDP and the logging keys: exact messages,
with GPU machines simulated (`cuda_available`, `te_on_gpu`), and parse-time checks of the new keys. The Megatron-FSDP
refusals name the installed megatron-core release and its source lines (run on 0.16.1 and 0.19.2 in CI)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.validate import validate

pytestmark = pytest.mark.mcore

NO_CKPT = ["checkpoint.interval=null", "checkpoint.save_at_end=false", "train.exit_signal_handler=false"]


def problems(overrides: list[str], world: int = 1, gpu: bool = False, te: bool = False) -> list[str]:
    report = validate(load_config("tiny_llama", overrides), world, te_on_gpu=te, cuda_available=gpu)
    return [str(p) for p in report.errors]


ROPE_POSITIONS = ("[data.reset_position_ids, model.position_embedding_type] data.reset_position_ids=true has no "
                  "effect with RoPE: Megatron-Core's GPTModel rotates by the sequence index, not by position_ids. "
                  "Fix: also set data.reset_attention_mask=true (then each document sees only its own tokens and "
                  "RoPE's relative positions are the restarted ones), or set data.reset_position_ids=false")
MCORE = metadata.version("megatron-core")


def line_of(path: str, text: str, after: str | None = None) -> int:
    """The number of the first line of the installed megatron-core's `path` (under megatron/core/distributed/fsdp)
    that contains `text` (the line after the first one containing `after`, when given)."""
    import importlib.util

    core = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0])  # read, not imported
    lines = (core / "distributed" / "fsdp" / path).read_text().splitlines()
    for i, line in enumerate(lines):
        if (after or text) in line:
            if after is not None:
                assert text in lines[i + 1], (path, after, lines[i + 1])
            return i + 1 + (after is not None)
    raise AssertionError(f"{text!r} not in {path} of megatron-core {MCORE}")


# The Megatron-FSDP source lines the refusals quote, found in the installed release: the adapter's device mesh
# (the world rearranged as (dp_cp ep tp)); the optim strategy's reduce in the backward hook and again in
# finish_grad_sync; where it turns the overlaps on itself; the gradient buffer left unsharded at DP1.
FSDP = "src/megatron_fsdp/megatron_fsdp.py"
MESH = f"mcore_fsdp_adapter.py:{line_of('mcore_fsdp_adapter.py', '(dp_cp ep tp) -> ep dp_cp tp')}"
OPTIM = (f"megatron_fsdp.py:{line_of(FSDP, 'if grad_reduce_every_bprop or is_last_microbatch')}, "
         f":{line_of(FSDP, 'self.start_grad_sync()', after='Synchronous gradient all-reduce when sharding optimizer')}")
OVERLAP = (f"megatron_fsdp.py:{line_of(FSDP, 'self.ddp_config.overlap_param_gather = True')}, "
           f":{line_of(FSDP, 'self.ddp_config.overlap_grad_reduce = True')}")
GRAD_BUFFER = "param_and_grad_buffer.py:" + str(line_of(
    "src/megatron_fsdp/param_and_grad_buffer.py", "is_data_distributed=is_grad_buffer_distributed and main_buf_dp"))
FSDP_PP = (f"[optimizer.fsdp, parallel.pipeline] Megatron-FSDP does not support pipeline parallelism in megatron-core "
           f"{MCORE}: its device mesh is the world rearranged as (DP×CP, EP, TP), with no pipeline dimension ({MESH}), "
           "so parallel.pipeline=2 fails at start-up. Fix: set parallel.pipeline=1 (shard over more DP ranks instead), "
           "or use optimizer.fsdp=false optimizer.distributed=true")
FSDP_OPTIM = ("[optimizer.fsdp_sharding] optimizer.fsdp_sharding=optim gives wrong gradients in megatron-core "
              f"{MCORE}: Megatron-FSDP's optim strategy reduces them in the last microbatch's backward hook and again "
              f"in finish_grad_sync ({OPTIM}); measured at DP2 on gloo, grad norm 2.07 where the distributed optimizer "
              "has 1.03 (1.62 with overlap_grad_reduce). Fix: use optimizer.fsdp=false optimizer.distributed=true "
              "(the distributed optimizer is ZeRO-1), or optimizer.fsdp_sharding=optim_grads / optim_grads_params")
FSDP_NAN = ("[optimizer.fsdp, train.nan_policy] train.nan_policy=skip checks DDP's gradient buffers, which "
            "Megatron-FSDP does not have. Fix: set train.nan_policy=stop")
FSDP_NO_FSDP = ("[optimizer.fsdp_sharding, optimizer.fsdp] optimizer.fsdp_sharding=optim_grads is set but "
                "optimizer.fsdp=false, so Megatron-FSDP is off. Fix: set optimizer.fsdp=true (or "
                "optimizer.fsdp_sharding=null)")
FSDP_OVERLAP_NOTE = ("optimizer.fsdp_sharding=optim_grads_params: Megatron-FSDP turns optimizer.overlap_param_gather "
                     f"and optimizer.overlap_grad_reduce on itself ({OVERLAP})")


@pytest.mark.parametrize("overrides,gpu,te,expected", [
    # Document boundaries: packed sequences (THD) for Transformer Engine and the local spec alike.
    (["data.reset_attention_mask=true"], True, True, []),
    (["data.reset_attention_mask=true", "model.transformer_impl=local"], True, True, []),
    (["data.reset_attention_mask=true"], False, False, []),  # CPU: local spec
    (["data.reset_position_ids=true"], False, False, [ROPE_POSITIONS]),
    (["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"], False, False, []),
    (["data.eod_mask_loss=true"], True, True, []),  # a loss mask: every implementation
    # Selective recompute modules.
    (["model.recompute_modules=[mlp]"], False, False,
     ["[model.recompute_modules, model.recompute_granularity] model.recompute_modules is only used with "
      "model.recompute_granularity=selective. Fix: set model.recompute_granularity=selective or "
      "model.recompute_modules=null"]),
    (["model.recompute_granularity=selective", "model.recompute_modules=[]"], False, False,
     ["[model.recompute_modules] model.recompute_modules=[] recomputes nothing. Fix: list modules (core_attn, mlp, "
      "layernorm) or set model.recompute_granularity=null"]),
    (["model.recompute_granularity=selective", "model.recompute_modules=[mlp,mlp]"], False, False,
     ["[model.recompute_modules] model.recompute_modules=['mlp', 'mlp'] names a module twice. Fix: list each "
      "module once"]),
    (["model.recompute_granularity=selective", "model.recompute_modules=[layernorm,mlp]"], True, True,
     ["[model.recompute_modules, model.transformer_impl] recompute of layernorm does nothing with the Transformer "
      "Engine spec on a dense model without MLA (both norms are fused into the following linear layers). "
      "Fix: remove layernorm, or set model.transformer_impl=local"]),
    (["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]"], True, True, []),
    # Logging.
    (["logging.wandb.entity=team"], False, False,
     ["[logging.wandb.project] logging.wandb.entity/name are set but logging.wandb.project is null, so nothing "
      "goes to Weights & Biases. Fix: set logging.wandb.project"]),
    (["logging.profile.end_step=3"], False, False,
     ["[logging.profile.end_step, logging.profile.start_step] logging.profile.end_step is set without "
      "logging.profile.start_step. Fix: set logging.profile.start_step (the first profiled step)"]),
    (["logging.profile.start_step=5", "logging.profile.end_step=4"], False, False,
     ["[logging.profile.start_step, logging.profile.end_step] profile window 5..4 is empty. "
      "Fix: use 1 <= start_step <= end_step"]),
    (["logging.profile.start_step=29", "logging.profile.end_step=31", "logging.profile.ranks=[0,2]"], False, False,
     ["[logging.profile.end_step, train.steps] profile window ends at step 31, after the last step "
      "(train.steps=30). Fix: end the window by step 30",
      "[logging.profile.ranks] logging.profile.ranks=[0, 2] must name ranks of the job (0..0). Fix: e.g. "
      "logging.profile.ranks=[0]"]),
    (["logging.profile.memory=true"], False, False,
     ["[logging.profile.memory, logging.profile.start_step] logging.profile.memory=true records allocations inside a "
      "profile window, and logging.profile.start_step is null (no window). Fix: set logging.profile.start_step"]),
    (["logging.profile.start_step=3"], False, False, []),  # one step: end_step defaults to start_step
    (["logging.timing_interval=0"], False, False,
     ["[logging.timing_interval] logging.timing_interval=0 must be at least 1. Fix: set "
      "logging.timing_interval to a positive integer, or null"]),
])
def test_rule(overrides, gpu, te, expected):
    assert problems(overrides, gpu=gpu, te=te) == expected


def test_wandb_missing_is_reported(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert problems(["logging.wandb.project=p"]) == [
        "[logging.wandb.project] logging.wandb.project is set but the wandb package is not installed. Fix: pip "
        "install -e '.[wandb]' (or set logging.wandb.project=null)"]
    assert problems(["logging.wandb.project=p", "logging.wandb.mode=disabled"]) == []


@pytest.mark.parametrize("override,message", [
    ("model.recompute_modules=[core_attn,experts]", "model.recompute_modules: 'experts' is not one of core_attn, mlp, "
     "layernorm, moe, moe_act, mla_up_proj, shared_experts"),
    ("model.recompute_modules=mlp", "'model.recompute_modules' must be a list of core_attn, mlp, layernorm, moe, "
     "moe_act, mla_up_proj, shared_experts, got 'mlp'"),
    ("logging.wandb.mode=cloud", "logging.wandb.mode='cloud' is not one of online, offline, disabled"),
    ("logging.profile.ranks=[zero]", "'logging.profile.ranks' must be of type list of int, got ['zero'] (list)"),
    ("data.eod_mask_loss=yes please", "'data.eod_mask_loss' must be of type bool, got 'yes please' (str)"),
])
def test_new_keys_checked_at_parse_time(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_llama", [override])
    assert str(err.value) == message


SEL = "model.recompute_granularity=selective"


@pytest.mark.parametrize("config,overrides,gpu,te,expected", [
    # moe / moe_act: MoE models only, one line on a dense model.
    ("tiny_llama", [SEL, "model.recompute_modules=[core_attn,moe]"], False, False,
     ["[model.recompute_modules, model.num_moe_experts] recompute of moe needs MoE layers and this model is dense "
      "(model.num_moe_experts=null). Fix: remove moe (mlp recomputes a dense model's MLP)"]),
    ("tiny_llama", [SEL, "model.recompute_modules=[moe,moe_act]"], True, True,
     ["[model.recompute_modules, model.num_moe_experts] recompute of moe, moe_act needs MoE layers and this model is "
      "dense (model.num_moe_experts=null). Fix: remove moe, moe_act (mlp recomputes a dense model's MLP)"]),
    ("tiny_moe", [SEL, "model.recompute_modules=[core_attn,moe,layernorm]"], False, False, []),
    ("tiny_moe", [SEL, "model.recompute_modules=[moe]"], True, True, []),
    ("tiny_moe", [SEL, "model.recompute_modules=[moe_act]"], True, True, []),  # TE spec: grouped GEMM
    # moe_act: megatron-core 0.16.1 refuses it without grouped GEMM (the local spec's SequentialMLP).
    ("tiny_moe", [SEL, "model.recompute_modules=[moe_act]"], False, False,
     ["[model.recompute_modules, model.moe_grouped_gemm] recompute of moe_act needs the grouped-GEMM experts of the "
      "Transformer Engine spec (megatron-core refuses it with the local spec's SequentialMLP). Fix: use moe (the "
      "whole MoE layer), or run on a GPU with transformer-engine"]),
    ("tiny_moe", [SEL, "model.recompute_modules=[moe_act]", "model.fp8=delayed"], True, True,
     ["[model.recompute_modules, model.fp8] recompute of moe_act does not work with delayed FP8 scaling "
      "(megatron-core). Fix: set model.fp8=tensorwise, or remove moe_act"]),
    # mlp is a no-op on MoE layers (TransformerLayer recomputes only a dense MLP): refused when every layer is MoE.
    ("tiny_moe", [SEL, "model.recompute_modules=[mlp]"], False, False,
     ["[model.recompute_modules] recompute of mlp does nothing on MoE layers (Megatron-Core skips them) and every "
      "layer of this model is MoE. Fix: use moe (the whole MoE layer) instead of mlp"]),
    # DeepSeek-V3's recipes: MLA's up-projections, the shared experts, the dense-first layers' MLP; layernorm under TE
    # (MLA and MoE norms are not fused into a linear layer).
    ("tiny_deepseek", [SEL, "model.recompute_modules=[mla_up_proj,shared_experts,mlp,layernorm]"], True, True, []),
    ("tiny_moe", [SEL, "model.recompute_modules=[mla_up_proj]"], False, False,
     ["[model.recompute_modules, model.multi_latent_attention] recompute of mla_up_proj needs multi-latent attention "
      "(model.multi_latent_attention=false; megatron-core refuses it). Fix: remove mla_up_proj"]),
    ("tiny_llama", [SEL, "model.recompute_modules=[shared_experts]"], False, False,
     ["[model.recompute_modules, model.num_moe_experts] recompute of shared_experts needs MoE layers and this model is "
      "dense (model.num_moe_experts=null). Fix: remove shared_experts (mlp recomputes a dense model's MLP)"]),
    ("tiny_moe", [SEL, "model.recompute_modules=[shared_experts]"], False, False,
     ["[model.recompute_modules, model.moe_shared_expert_intermediate_size] recompute of shared_experts needs shared "
      "experts (model.moe_shared_expert_intermediate_size=null). Fix: remove shared_experts"]),
])  # fmt: skip
def test_moe_recompute_modules(config, overrides, gpu, te, expected):
    report = validate(load_config(config, overrides), 1, te_on_gpu=te, cuda_available=gpu)
    assert [str(p) for p in report.errors] == expected


@pytest.mark.parametrize("overrides,gpu,expected", [
    # Megatron-FSDP on CPU and GPU, with checkpoints (fsdp_dtensor); what megatron-core does not support.
    (["optimizer.fsdp=true"], False, []),
    (["optimizer.fsdp=true", "checkpoint.async_save=true"], True, []),
    (["optimizer.fsdp=true", "optimizer.fsdp_sharding=optim_grads"], False, []),
    (["optimizer.fsdp_sharding=optim_grads"], False, [FSDP_NO_FSDP]),
    (["optimizer.fsdp=true", "optimizer.fsdp_sharding=optim"], False, [FSDP_OPTIM]),
    (["optimizer.fsdp=true", "train.nan_policy=skip"], True, [FSDP_NAN]),
])
def test_fsdp_rule(overrides, gpu, expected):
    assert problems(overrides, world=2, gpu=gpu, te=gpu) == expected


def test_fsdp_on_one_data_parallel_rank():
    got = problems(["optimizer.fsdp=true", "parallel.tensor=2"], world=2)
    if MCORE == "0.19.2":
        assert got == []
    else:
        assert got == [
            "[optimizer.fsdp] Megatron-FSDP with one data-parallel rank gives wrong gradients in megatron-core "
            f"{MCORE}: its gradient buffer is then not sharded ({GRAD_BUFFER}) and the gradients come "
            "out too large — measured on gloo (0.16.1) 2× with one microbatch (grad norm 3.82 where DDP has 1.91) "
            "and 8.8× with four; megatron-core 0.19.2 is right. Fix: run Megatron-FSDP on at least two data-parallel "
            "ranks (it has nothing to shard on one), use optimizer.fsdp=false, or megatron-core 0.19"]


def test_fsdp_notes_and_expert_parallelism():
    """What Megatron-FSDP decides itself is one note; FSDP × EP only where megatron-core's grad norm is right."""
    report = validate(load_config("tiny_llama", ["optimizer.fsdp=true"]), 2, te_on_gpu=False, cuda_available=False)
    assert FSDP_OVERLAP_NOTE in report.notes, report.notes
    assert problems(["optimizer.fsdp=true", "parallel.pipeline=2"], world=4) == [FSDP_PP]  # DP2: only the PP rule
    report = validate(load_config("tiny_moe", ["optimizer.fsdp=true", "parallel.expert=2"]), 2, te_on_gpu=False,
                      cuda_available=False)
    errors = [str(p) for p in report.errors]
    if MCORE == "0.19.2":
        assert errors == []
    else:
        assert errors == [
            f"[optimizer.fsdp, parallel.expert] Megatron-FSDP with expert parallelism reports a wrong gradient norm in "
            f"megatron-core {MCORE}, so gradient clipping scales the updates wrongly: on tiny_moe at DP2 × EP2 "
            "(gloo, 0.16.1) the step-1 grad norm is 1.0952 where DDP, the distributed optimizer and Megatron-FSDP at "
            "EP1 give 0.9830; megatron-core 0.19.2 gives 0.9830. Fix: set parallel.expert=1 (Megatron-FSDP then "
            "shards the experts over DP), use optimizer.fsdp=false optimizer.distributed=true, or megatron-core 0.19"]
