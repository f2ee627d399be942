"""Torchrun worker for tests/pretrain/test_plan.py: build real Megatron ranks for several layouts (one
process-group launch), count the bytes each rank holds, and compare with the planner's prediction.

    torchrun --standalone --nproc-per-node W tests/pretrain/plan_worker.py OUT.json

Each rank builds the model through pretrain's own path (init_model_parallel → build_model → wrap_with_ddp →
build_optimizer), takes one optimizer step so Adam's state exists, and measures:

- weights: bytes of the distinct storages behind the model's parameters (the DDP parameter buffer with the
  distributed optimizer);
- gradients: bytes of DDP's grad buffers (`buffers[*].grad_data`);
- optimizer: Adam's exp_avg/exp_avg_sq plus main parameters that are not model storage (fp32 copies or
  shards under bf16).
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
]  # fmt: skip


def storage_key(t) -> int:
    return t.untyped_storage().data_ptr()


def measure(chunks, model, optimizer) -> dict[str, int]:
    """Bytes this rank holds for weights, gradient buffers and optimizer state."""
    storages: dict[int, int] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            storages[storage_key(p)] = p.untyped_storage().nbytes()
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in model for b in c.buffers)
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
    from pretrain import plan
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.runtime import init_model_parallel
    from pretrain.train import build_optimizer, wrap_with_ddp

    cfg = load_config(config, overrides)
    layout = derive_layout(cfg, dist.get_world_size(), on_gpu=False)
    init_model_parallel(layout, cfg.train.seed)
    chunks = build_model(cfg, layout)
    model = wrap_with_ddp(cfg, chunks, chunks[0].config)
    optimizer = build_optimizer(cfg, model, layout)
    for c in model:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()  # Adam's state is created on the first step

    measured = measure(chunks, model, optimizer)
    lay = plan.layout_of(cfg, dist.get_world_size(), on_gpu=False, use_te=False)
    padded = layout.padded_vocab
    pp_rank = ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    st = plan.static_memory(cfg, lay, padded, pp_rank, dp_rank=dp_rank)
    predicted = {"weights": st.weights, "gradients": st.gradients, "optimizer": st.optimizer}
    names_ok = all(
        [(n, p.numel()) for n, p in chunk.named_parameters()]
        == [(p.name, p.numel) for p in plan.chunk_parameters(cfg, lay, padded, pp_rank, v)]
        for v, chunk in enumerate(chunks)
    )
    record = {"layout": name, "rank": dist.get_rank(), "pp_rank": pp_rank, "dp_rank": dp_rank,
              "tp_rank": ps.get_tensor_model_parallel_rank(), "measured": measured, "predicted": predicted,
              "names_match": names_ok}  # fmt: skip
    del model, optimizer, chunks
    gc.collect()
    return record


def main() -> int:
    import torch.distributed as dist

    from pretrain import compat
    from pretrain.runtime import init_distributed, shutdown

    out = sys.argv[1]
    compat.apply()
    rt = init_distributed()
    results = []
    try:
        for name, world, config, overrides in LAYOUTS:
            if world != rt.world_size:
                continue
            record = run_layout(name, config, overrides)
            gathered: list = [None] * rt.world_size
            dist.all_gather_object(gathered, record)
            results += gathered
    finally:
        if rt.rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
