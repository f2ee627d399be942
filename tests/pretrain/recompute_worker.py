"""Bytes autograd holds for backward after one microbatch's forward, per config (one process, CPU).

    python -m tests.pretrain.recompute_worker CASES.json OUT.json

CASES.json: [{"name": ..., "overrides": [...], "config": ...}, ...] (config: tiny_llama unless given). Each case
builds the model the trainer builds (`model_providers.core.builder.build_model` from the config and its derived
layout), reads the trainer's first microbatch (`pretrain.data.datasets`), and runs the trainer's `forward_step` under
`torch.autograd.graph.saved_tensors_hooks`.
Held bytes: the planner's `SavedTensorMeter` (distinct storages saved for backward, parameters excluded), sized when
the forward has returned (selective recompute of norms frees its outputs' storage after use). Backward then runs, so
recompute is exercised.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


def held_bytes(model, forward) -> tuple[int, float]:
    """(bytes saved for backward and alive once `forward()` has returned, the loss), then backward.

    Counted by the planner's `SavedTensorMeter` (distinct storages, parameters excluded), sized after the forward.
    """
    from pretrain.planner.measure import SavedTensorMeter, parameter_storages

    meter = SavedTensorMeter(excluded=lambda: parameter_storages([model]))
    with meter:
        loss = forward()
        held = meter.held()
        loss.backward()
    return held, float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from megatron.core.num_microbatches_calculator import (
        init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )

    from model_providers.core.builder import build_model
    from model_providers.core.model_plan import model_plan
    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.data.datasets import build_datasets, microbatches
    from pretrain.data.plan import data_plan
    from pretrain.layout import derive_layout
    from pretrain.run.runtime import init_distributed, init_model_parallel, shutdown
    from pretrain.tokenizer.load import run_tokenizer
    from pretrain.train import forward_step

    compat.apply()  # as the trainer does at start-up
    cases = json.loads(open(argv[0]).read())
    out = {}
    rt = init_distributed()
    try:
        for case in cases:
            cfg = load_config(case.get("config", "tiny_llama"), case["overrides"])
            tokenizer = run_tokenizer(cfg.data)
            layout = derive_layout(cfg, rt.world_size, vocab_size=tokenizer.vocab_size, on_gpu=rt.on_gpu)
            init_model_parallel(layout, cfg.train.seed)
            unset_num_microbatches_calculator()
            init_num_microbatches_calculator(0, None, cfg.train.global_batch_size, cfg.train.micro_batch_size, 1)
            (model,) = build_model(model_plan(cfg), layout)
            model.train()
            train_ds, _ = build_datasets(data_plan(cfg), tokenizer, cfg.train.global_batch_size)
            (batch,) = microbatches(train_ds, 0, num_microbatches=1, micro_batch_size=cfg.train.micro_batch_size,
                                    dp_rank=0, dp_size=1, device=rt.device)

            def forward(model=model, batch=batch):
                output, loss_fn = forward_step(iter([batch]), model)
                loss_sum, count, _ = loss_fn(output)
                return loss_sum / count

            held, loss = held_bytes(model, forward)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            out[case["name"]] = {"held_bytes": held, "loss": loss,
                                 "grad_norm": float(sum((g.double() ** 2).sum() for g in grads.values()) ** 0.5)}
            print(f"[recompute_worker] {case['name']}: held {held} bytes, loss {loss:.6f}", flush=True)
    finally:
        shutdown()
    open(argv[1], "w").write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
