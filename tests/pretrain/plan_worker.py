"""Torchrun worker for tests/pretrain/test_plan.py: real Megatron ranks for several layouts (one
process-group launch per world size), the bytes each rank holds, and the planner's prediction for them.

    torchrun --standalone --nproc-per-node W tests/pretrain/plan_worker.py OUT.json [LAYOUT-OR-CASE ...]

OUT.json: {"static": [...], "activations": [...]}, one record per rank and layout.

Static memory (LAYOUTS): each rank builds the model through pretrain's own path (init_model_parallel →
build_model → wrap_with_ddp → build_optimizer), takes one optimizer step so Adam's state exists, and measures:

- weights: bytes of the distinct storages behind the model's parameters (the DDP parameter buffer with the
  distributed optimizer);
- gradients: bytes of DDP's grad buffers (`buffers[*].grad_data`);
- optimizer: Adam's exp_avg/exp_avg_sq plus main parameters that are not model storage (fp32 copies or
  shards under bf16).

Activations (ACTIVATION_CASES): each rank trains one step through `train()` with
`pretrain.planner.measure.SavedTensorMeter` around it (saved_tensors_hooks; storages counted once, parameters
excluded) and records `peak`, the most bytes autograd held at once, and `layers`, the bytes first saved inside
each decoder layer's forward of the first microbatch (MoE at EP > 1: the expert-parallel group's mean);
predicted: the planner's peak for this pipeline stage (stored activations + the recompute working set beyond them)
and its per-layer bytes.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

# (name, world, config, overrides). Vocabulary sizes are explicit so no tokenizer is loaded.
TINY = ["model.vocab_size=32000"]
M100 = TINY + ["model.num_layers=8", "model.hidden_size=768", "model.ffn_hidden_size=2048",
               "model.num_attention_heads=12", "model.num_query_groups=4", "model.seq_length=128"]
LAYOUTS: list[tuple[str, int, str, list[str]]] = [
    ("tiny fp32 DP2 distopt", 2, "tiny_llama", TINY + ["optimizer.distributed=true"]),
    ("tiny fp32 TP2 SP", 2, "tiny_llama", TINY + ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("tiny bf16 PP2", 2, "tiny_llama", TINY + ["parallel.pipeline=2", "train.precision=bf16"]),
    ("tiny fp32 TP2 PP2", 4, "tiny_llama", TINY + ["parallel.tensor=2", "parallel.pipeline=2"]),
    ("tiny fp32 PP2 VP2 DP2 distopt", 4, "tiny_llama",
     TINY + ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "optimizer.distributed=true"]),
    ("tiny bf16 TP2 DP2 distopt", 4, "tiny_llama",
     TINY + ["parallel.tensor=2", "train.precision=bf16", "optimizer.distributed=true"]),
    ("tiny bf16 DP4 distopt overlap", 4, "tiny_llama",
     TINY + ["train.precision=bf16", "optimizer.distributed=true", "optimizer.overlap_grad_reduce=true"]),
    ("tiny_gpt fp32 PP2 DP2 distopt (tied)", 4, "tiny_gpt",
     ["model.vocab_size=50257", "parallel.pipeline=2", "optimizer.distributed=true"]),
    ("100M fp32 TP2 PP2", 4, "tiny_llama", M100 + ["parallel.tensor=2", "parallel.pipeline=2"]),
    ("100M bf16 PP2 VP2 DP2 distopt", 4, "tiny_llama",
     M100 + ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "train.precision=bf16",
             "optimizer.distributed=true"]),
    ("100M bf16 TP2 DP2 distopt", 4, "tiny_llama",
     M100 + ["parallel.tensor=2", "train.precision=bf16", "optimizer.distributed=true"]),
    # MoE: expert weights in their own DDP buffers, sharded over expert data parallel.
    ("tiny_moe fp32 EP2 DP2 distopt", 2, "tiny_moe", TINY + ["parallel.expert=2", "optimizer.distributed=true"]),
    ("tiny_moe bf16 EP2 DP4 (EDP2) distopt", 4, "tiny_moe",
     TINY + ["parallel.expert=2", "train.precision=bf16", "optimizer.distributed=true"]),
    ("tiny_moe bf16 TP2 SP PP2 EP2 ETP1", 4, "tiny_moe",
     TINY + ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2", "parallel.expert=2",
             "parallel.expert_tensor=1", "train.precision=bf16"]),
    # DeepSeek-V3 class: MLA (TP-split down-projections on the local spec), shared experts, a dense first layer,
    # the expert bias (a buffer, not a parameter), MTP with its embedding copy on the last stage.
    ("tiny_deepseek fp32 EP2 DP2 distopt", 2, "tiny_deepseek",
     TINY + ["parallel.expert=2", "optimizer.distributed=true"]),
    ("tiny_deepseek bf16 TP2 SP PP2 EP2 ETP1 distopt", 4, "tiny_deepseek",
     TINY + ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2", "parallel.expert=2",
             "parallel.expert_tensor=1", "train.precision=bf16", "optimizer.distributed=true"]),
]  # fmt: skip


# Shapes: small enough for 2 CPU cores, with a vocabulary small enough that the layers, not the loss, dominate.
LLAMA = ["model.vocab_size=4096", "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=704",
         "model.num_attention_heads=8", "model.num_query_groups=4", "model.seq_length=256"]
LLAMA_MHA = ["model.vocab_size=4096", "model.num_layers=8", "model.hidden_size=192", "model.ffn_hidden_size=512",
             "model.num_attention_heads=6", "model.num_query_groups=null", "model.seq_length=128"]
GPT = ["model.vocab_size=4096", "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024",
       "model.num_attention_heads=8", "model.seq_length=256"]
BF16 = ["train.precision=bf16"]
# MoE (8 experts, top-2, aux and z-loss): at EP1 a rank's experts see exactly T·k token copies (dropless).
MOE = ["model.vocab_size=4096", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.seq_length=256",
       "model.moe_z_loss_coeff=1.0e-3"]
# DeepSeek-V3 class: tiny_deepseek's shape at a larger hidden size, so that the layers, not the loss, dominate.
DEEPSEEK = ["model.vocab_size=4096", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.seq_length=256"]
SELECTIVE = ["model.recompute_granularity=selective"]
CP2 = ["parallel.context=2"]
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
BLOCK = ["model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=1"]

# (name, world, config, overrides)
ACTIVATION_CASES: list[tuple[str, int, str, list[str]]] = [
    ("llama bf16 DP2 mbs2", 2, "tiny_llama", LLAMA + BF16 + ["train.micro_batch_size=2", "train.global_batch_size=4"]),
    ("llama fp32 DP2", 2, "tiny_llama", LLAMA + ["train.precision=fp32", "train.micro_batch_size=1",
                                                 "train.global_batch_size=2"]),
    ("llama bf16 TP2", 2, "tiny_llama", LLAMA + BF16 + ["parallel.tensor=2", "train.micro_batch_size=1",
                                                        "train.global_batch_size=2"]),
    ("llama bf16 TP2 SP", 2, "tiny_llama", LLAMA + BF16 + ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                                           "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("llama bf16 PP2 M4", 2, "tiny_llama", LLAMA + BF16 + ["parallel.pipeline=2", "train.micro_batch_size=1",
                                                           "train.global_batch_size=4"]),
    ("llama bf16 PP2 VP2 M4", 2, "tiny_llama", LLAMA + BF16 + [
        "parallel.pipeline=2", "parallel.virtual_pipeline=2", "train.micro_batch_size=1",
        "train.global_batch_size=4"]),
    ("llama bf16 DP2 selective", 2, "tiny_llama", LLAMA + BF16 + SELECTIVE + [
        "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("llama bf16 DP2 full uniform", 2, "tiny_llama", LLAMA + BF16 + FULL + [
        "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("llama bf16 TP2 SP fused SwiGLU", 2, "tiny_llama", LLAMA + BF16 + [
        "model.bias_activation_fusion=true", "parallel.tensor=2", "parallel.sequence_parallel=true",
        "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("gpt bf16 TP2 SP", 2, "tiny_gpt", GPT + BF16 + ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                                     "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("mha bf16 PP4 VP2 M8", 4, "tiny_llama", LLAMA_MHA + BF16 + [
        "parallel.pipeline=4", "parallel.virtual_pipeline=2", "train.micro_batch_size=1",
        "train.global_batch_size=8"]),
    ("llama bf16 TP2 SP PP2 M4 selective", 4, "tiny_llama", LLAMA + BF16 + SELECTIVE + [
        "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2", "train.micro_batch_size=1",
        "train.global_batch_size=4"]),
    ("llama bf16 TP2 SP PP2 VP2 M4 full block", 4, "tiny_llama", LLAMA + BF16 + BLOCK + [
        "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
        "parallel.virtual_pipeline=2", "train.micro_batch_size=1", "train.global_batch_size=4"]),
    ("moe bf16 DP2 EP1", 2, "tiny_moe", MOE + BF16 + ["train.micro_batch_size=1", "train.global_batch_size=2"]),
    # EP > 1: a rank's experts get the tokens routed to them; the planner counts balanced routing, so the mean over
    # the expert-parallel group is compared (the all-to-all moves T·k copies in all).
    ("moe bf16 EP2", 2, "tiny_moe", MOE + BF16 + ["parallel.expert=2", "train.micro_batch_size=1",
                                                  "train.global_batch_size=2"]),
    ("moe fp32 EP2 selective moe", 2, "tiny_moe", MOE + ["parallel.expert=2", "model.recompute_granularity=selective",
                                                         "model.recompute_modules=[moe]", "train.micro_batch_size=1",
                                                         "train.global_batch_size=2"]),
    ("moe bf16 TP2 SP EP2 ETP2", 4, "tiny_moe", MOE + BF16 + [
        "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2", "train.micro_batch_size=1",
        "train.global_batch_size=2"]),
    # DeepSeek-V3 class (MLA, sigmoid routing in 2 groups with the expert bias, a shared expert, a dense first
    # layer, MTP): per layer and stage peak within 1%.
    ("deepseek bf16 TP2 SP EP2", 2, "tiny_deepseek", DEEPSEEK + BF16 + [
        "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2", "parallel.expert_tensor=1",
        "train.micro_batch_size=1", "train.global_batch_size=2"]),
    ("deepseek fp32 PP2 EP2 M4", 4, "tiny_deepseek", DEEPSEEK + [
        "parallel.pipeline=2", "parallel.expert=2", "train.micro_batch_size=1", "train.global_batch_size=4"]),
    # Context parallelism without TE: the local spec's CP attention (pretrain.planner.context), one per comm type
    # (a2a under core-attention recompute: its saved terms are the recompute working set at the peak); packed
    # documents (THD: the micro batch is one sequence; mock documents, padded to multiples of 2×CP: not counted).
    ("llama bf16 CP2 p2p", 2, "tiny_llama", LLAMA + BF16 + CP2 + ["train.micro_batch_size=1",
                                                                  "train.global_batch_size=2"]),
    ("llama bf16 CP2 all_gather THD mbs2", 2, "tiny_llama", LLAMA + BF16 + CP2 + [
        "parallel.cp_comm_type=all_gather", "data.reset_attention_mask=true", "train.micro_batch_size=2",
        "train.global_batch_size=2"]),
    ("llama fp32 CP2 a2a selective", 2, "tiny_llama", LLAMA + SELECTIVE + CP2 + [
        "train.precision=fp32", "parallel.cp_comm_type=a2a", "train.micro_batch_size=1",
        "train.global_batch_size=2"]),
    ("llama bf16 TP2 SP CP2 p2p", 4, "tiny_llama", LLAMA + BF16 + CP2 + [
        "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch_size=1",
        "train.global_batch_size=2"]),
]  # fmt: skip

# Mock data with no tokenizer file of a type that embeds none: the null tokenizer of model.vocab_size ids, so the
# small vocabularies above need no embedding rows beyond their own (the vocabulary rule, pretrain/data/vocab.py).
RUN = ["data.mock=true", "data.tokenizer_type=huggingface", "data.tokenizer_model=null", "train.steps=1",
       "optimizer.warmup_steps=0", "checkpoint.save_at_end=false",
       "checkpoint.interval=null", "logging.tensorboard=false", "train.eval_interval=null"]  # fmt: skip


def run_activation_case(name: str, config: str, overrides: list[str], run_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import model_providers.core.builder as builder
    from pretrain import planner
    from pretrain.config import load_config
    from pretrain.planner.activations import recomputed_modules, stage_layers
    from pretrain.planner.measure import SavedTensorMeter, parameter_storages
    from pretrain.train import train

    cfg = load_config(config, [*overrides, *RUN, f"run.dir={run_dir}"])
    chunks: list = []
    meter = SavedTensorMeter(excluded=lambda: parameter_storages(chunks))
    original = builder.build_model

    def build_and_label(*args, **kwargs):
        built = original(*args, **kwargs)
        chunks.extend(built)
        meter.label_layers(built, TransformerLayer)
        return built

    builder.build_model = build_and_label
    try:
        with meter:
            train(cfg)
    finally:
        builder.build_model = original
    lay = planner.layout_of(cfg, dist.get_world_size(), on_gpu=False, use_te=False)
    vocab = planner.padded_vocab_for(cfg)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    act = planner.activation_memory(cfg, lay, vocab, pp_rank)
    layers = [meter.by_label[k] for k in sorted(meter.by_label)]
    measured = {"peak": meter.peak, "layers": layers}
    if lay.ep > 1:  # routing is not balanced: the expert-parallel group's mean (its sum is what was routed)
        group: list = [None] * lay.ep
        dist.all_gather_object(group, measured, group=ps.get_expert_model_parallel_group())
        measured = {"peak": sum(g["peak"] for g in group) // lay.ep, "peak_ranks": [g["peak"] for g in group],
                    "layers": [sum(col) // lay.ep for col in zip(*(g["layers"] for g in group))],
                    "layers_ranks": [g["layers"] for g in group]}
    return {
        "case": name, "rank": dist.get_rank(), "pp_rank": pp_rank, "tp_rank": ps.get_tensor_model_parallel_rank(),
        "measured": measured,
        "predicted": {"peak": act.peak, "saved": act.saved, "recompute": act.recompute,
                      "layer": planner.layer_activation_bytes(cfg, lay, modules=recomputed_modules(cfg.model)),
                      "layers": [x for c in range(lay.vp)  # per layer: dense-first models, MTP layers
                                 for x in stage_layers(cfg, lay, pp_rank, c, recomputed_modules(cfg.model))]},
        "recompute": cfg.model.recompute_granularity,
    }  # fmt: skip


def storage_key(t) -> int:
    return t.untyped_storage().data_ptr()


def measure(chunks, model, optimizer) -> dict[str, int]:
    """Bytes this rank holds for weights, gradient buffers and optimizer state."""
    storages: dict[int, int] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            storages[storage_key(p)] = p.untyped_storage().nbytes()
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in model
                for b in [*c.buffers, *c.expert_parallel_buffers])
    moments = main = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for state in inner.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    moments += state[key].numel() * state[key].element_size()
        for group in inner.param_groups:
            for p in group["params"]:
                if storage_key(p) not in storages:
                    main += p.numel() * p.element_size()
    return {"weights": sum(storages.values()), "gradients": grads, "optimizer": moments + main}


def run_layout(name: str, config: str, overrides: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from model_providers.core.builder import build_model
    from model_providers.core.model_plan import model_plan
    from pretrain import plan
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.run.runtime import init_model_parallel
    from pretrain.run.setup import build_optimizer, wrap_with_ddp

    cfg = load_config(config, overrides)
    layout = derive_layout(cfg, dist.get_world_size(), on_gpu=False)
    init_model_parallel(layout, cfg.train.seed)
    chunks = build_model(model_plan(cfg), layout)
    model = wrap_with_ddp(cfg.optimizer, cfg.rerun, chunks, chunks[0].config)
    optimizer = build_optimizer(cfg.optimizer, model, layout)
    for c in model:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()  # Adam's state is created on the first step

    measured = measure(chunks, model, optimizer)
    lay = plan.layout_of(cfg, dist.get_world_size(), on_gpu=False, use_te=False)
    padded = layout.padded_vocab
    pp_rank = ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    st = plan.static_memory(cfg, lay, padded, pp_rank, dp_rank=dp_rank, edp_rank=ps.get_expert_data_parallel_rank())
    predicted = {"weights": st.weights, "gradients": st.gradients, "optimizer": st.optimizer}
    names_ok = all(
        [(n, p.numel()) for n, p in chunk.named_parameters()]
        == [(p.name, p.numel) for p in plan.chunk_parameters(cfg.model, lay, padded, pp_rank, v)]
        for v, chunk in enumerate(chunks)
    )
    # What the rank holds parameters of (Megatron marks expert parameters allreduce=False) and the run's settings:
    # the test's hand count of bytes per parameter starts from these, not from the planner.
    params = {id(p): p for chunk in chunks for p in chunk.parameters()}.values()
    held = {"dense": sum(p.numel() for p in params if getattr(p, "allreduce", True)),
            "expert": sum(p.numel() for p in params if not getattr(p, "allreduce", True)),
            "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
            "edp": ps.get_expert_data_parallel_world_size(), "precision": layout.precision,
            "distributed": cfg.optimizer.distributed, "grad_reduce_in_fp32": cfg.optimizer.grad_reduce_in_fp32}
    record = {"layout": name, "rank": dist.get_rank(), "pp_rank": pp_rank, "dp_rank": dp_rank,
              "tp_rank": ps.get_tensor_model_parallel_rank(), "measured": measured, "predicted": predicted,
              "names_match": names_ok, "held": held}  # fmt: skip
    del model, optimizer, chunks
    gc.collect()
    return record


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from pretrain import compat
    from pretrain.run.runtime import init_distributed, shutdown

    argv = sys.argv[1:] if argv is None else argv
    out = argv[0]
    compat.apply()
    only = set(argv[1:])
    rt = init_distributed()
    results: dict[str, list] = {"static": [], "activations": []}
    try:
        for name, world, config, overrides in LAYOUTS:
            if world != rt.world_size or (only and name not in only):
                continue
            record = run_layout(name, config, overrides)
            gathered: list = [None] * rt.world_size
            dist.all_gather_object(gathered, record)
            results["static"] += gathered
        for i, (name, world, config, overrides) in enumerate(ACTIVATION_CASES):
            if world != rt.world_size or (only and name not in only):
                continue
            record = run_activation_case(name, config, overrides, str(Path(out).parent / f"run_w{world}_{i}"))
            gathered = [None] * rt.world_size
            dist.all_gather_object(gathered, record)
            results["activations"] += gathered
    finally:
        if rt.rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
