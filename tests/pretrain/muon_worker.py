"""Muon cases on pool ranks (`tests/pretrain/test_muon.py`).

    python -m tests.pretrain.muon_worker reference OUT.json   one optimizer step of the trainer's Muon vs the
                                                              plain-PyTorch Muon + AdamW below
    python -m tests.pretrain.muon_worker qk_clip OUT.json     QK-clip after a step rescales exactly the heads over
                                                              the threshold
    python -m tests.pretrain.muon_worker switch CASES.json OUT.json   train() cases; a case with "refused" records
                                                              the CheckpointError it ends with

The reference is written from the published algorithm (Keller Jordan's Muon; Moonlight, arXiv 2502.16982): the
momentum buffer m = β·m + (1-β)·g (zero before the first step), Newton-Schulz iterations X ← aX + (bA + cA²)X with
A = XXᵀ (as two `addmm`s: fp32 rounds `aX + (bA + cA²)X` written out differently, ~1e-6 after 5 iterations)
on the Frobenius-normalised momentum (the shorter side first), Q, K and V of the fused QKV weight
orthogonalised separately, the update scaled by sqrt(max(rows, columns)) ("spectral"), decoupled weight decay
W ← W(1 - lr·wd) before the update; AdamW (torch's formula) for the embeddings, the output layer and 1-D tensors,
with no weight decay on 1-D tensors.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")

# Newton-Schulz quintic coefficients (a, b, c) per iteration, as published with Muon (modded-nanogpt)
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
OVERRIDES = ["model.num_layers=2", "model.vocab_size=1024", "optimizer.name=muon",
             "optimizer.muon.fp32_matmul_prec=highest", "optimizer.lr=0.02", "optimizer.weight_decay=0.1",
             "optimizer.clip_grad=1.0e9", "train.precision=fp32", "optimizer.warmup_steps=0",
             "optimizer.decay_style=constant"]


def orthogonalize(g, steps: int = 5):
    """Newton-Schulz orthogonalisation of a matrix (in fp32, the precision of the run), the shorter side first."""
    import torch

    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / torch.clamp(x.norm(), min=1e-7)
    for a, b, c in (QUINTIC * steps)[:steps]:
        A = x @ x.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # bA + cA²
        x = torch.addmm(x, B, x, beta=a)  # aX + BX
    return x.T if transposed else x


def muon_update(name: str, g, model_cfg, momentum: float):
    """The scaled orthogonalised first-step momentum of one matrix (QKV: Q, K, V separately)."""
    import torch

    buf = (1 - momentum) * g.float()
    if "linear_qkv.weight" not in name:
        return orthogonalize(buf).double() * max(buf.shape) ** 0.5
    heads, groups, d = model_cfg.num_attention_heads, model_cfg.num_query_groups, model_cfg.kv_channels
    shapes = [heads // groups * d, d, d]
    parts = torch.split(buf.view(groups, sum(shapes), -1), shapes, dim=1)
    out = []
    for part in parts:
        m = part.reshape(-1, buf.shape[-1])
        out.append((orthogonalize(m) * max(m.shape) ** 0.5).view(groups, -1, buf.shape[-1]))
    return torch.cat(out, dim=1).view(buf.shape).double()


def reference(out: str) -> int:
    import torch
    import torch.distributed as dist

    from model_providers.core.builder import build_model
    from model_providers.core.model_plan import model_plan
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.run.runtime import init_model_parallel
    from pretrain.run.setup import build_optimizer, build_scheduler, wrap_with_ddp

    cfg = load_config("tiny_llama", OVERRIDES)
    layout = derive_layout(cfg, dist.get_world_size(), on_gpu=False)
    init_model_parallel(layout, cfg.train.seed)
    chunks = build_model(model_plan(cfg), layout)
    model = wrap_with_ddp(cfg.optimizer, cfg.rerun, chunks, chunks[0].config)
    lines: list[str] = []
    optimizer = build_optimizer(cfg.optimizer, model, layout, lines.append)
    build_scheduler(cfg.optimizer, cfg.train.steps, optimizer)  # sets each group's lr and weight decay, as in training
    for c in model:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(0)
    seq = cfg.model.seq_length
    tokens = torch.randint(0, 1000, (2, seq), generator=gen)
    labels = torch.randint(0, 1000, (2, seq), generator=gen)
    position_ids = torch.arange(seq).unsqueeze(0).expand(2, -1)
    loss = model[0](tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    for c in model:
        c.finish_grad_sync()
    before = {n: (p.detach().clone().double(), p.main_grad.detach().clone().double())
              for n, p in chunks[0].named_parameters()}
    optimizer.step()
    o, mc = cfg.optimizer, chunks[0].config
    worst_w, worst_u, kinds = 0.0, 0.0, {"muon": 0, "adamw": 0}
    for n, p in chunks[0].named_parameters():
        w, g = before[n]
        wd = 0.0 if p.ndim == 1 or n.endswith(".bias") else o.weight_decay
        muon = p.ndim == 2 and not n.startswith(("embedding.", "output_layer."))
        kinds["muon" if muon else "adamw"] += p.numel()
        update = muon_update(n, g, mc, o.muon.momentum) if muon else g / (g.abs() + o.adam_eps)
        expected = w * (1 - o.lr * wd) - o.lr * update
        got = p.detach().double()
        worst_w = max(worst_w, float((got - expected).norm() / expected.norm()))
        worst_u = max(worst_u, float(((got - w) - (expected - w)).norm() / (expected - w).norm()))
    state = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for per_param in opt.optimizer.state.values():
            state += sum(t.numel() * t.element_size() for k, t in per_param.items()
                         if k in ("momentum_buffer", "exp_avg", "exp_avg_sq"))
    from pretrain.planner.muon import muon_memory

    mu = muon_memory(cfg, layout, layout.padded_vocab, 0)
    planned = {"muon": mu.muon_params, "adamw": mu.adamw_params, "state_bytes": mu.momentum + mu.moments}
    with open(out, "w") as f:
        json.dump({"weights_rel": worst_w, "update_rel": worst_u, "kinds": kinds, "line": lines,
                   "state_bytes": state, "planned": planned}, f)
    return 0


def qk_clip(out: str) -> int:
    """Megatron-Core's QK-clip through `pretrain.optim.muon.after_step` on tiny_llama (8 heads, 4 query groups):
    given the max logit each head recorded (what Transformer Engine's attention records; set here), the query rows
    of every group whose max passes the threshold are scaled by η^α and its key rows by η^(1-α), η = threshold /
    max; every other row and every value row stays as it was."""
    import torch
    import torch.distributed as dist

    from model_providers.core.builder import build_model
    from model_providers.core.model_plan import model_plan
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.optim.muon import after_step
    from pretrain.run.runtime import init_model_parallel
    from pretrain.run.setup import wrap_with_ddp

    cfg = load_config("tiny_llama", [*OVERRIDES, "optimizer.muon.qk_clip=true", "optimizer.muon.qk_clip_threshold=100",
                                     "optimizer.muon.qk_clip_alpha=0.5"])
    layout = derive_layout(cfg, dist.get_world_size(), on_gpu=False)
    init_model_parallel(layout, cfg.train.seed)
    chunks = build_model(model_plan(cfg), layout)
    model = wrap_with_ddp(cfg.optimizer, cfg.rerun, chunks, chunks[0].config)
    heads, groups, d = cfg.model.num_attention_heads, layout.num_query_groups, layout.head_dim
    logits = torch.tensor([50.0, 150.0, 90.0, 99.0, 400.0, 100.0, 10.0, 20.0])  # groups of 2: max 150, 99, 400, 20
    before = {}
    for i, layer in enumerate(chunks[0].decoder.layers):
        layer.self_attention.core_attention.current_max_attn_logits = logits.clone()
        before[i] = layer.self_attention.linear_qkv.weight.detach().clone()
    top = after_step(cfg.optimizer, model)
    results = []
    for i, layer in enumerate(chunks[0].decoder.layers):
        w0 = before[i].view(groups, (heads // groups + 2) * d, -1)
        w1 = layer.self_attention.linear_qkv.weight.detach().view_as(w0)
        q = heads // groups * d
        for g in range(groups):
            worst = float(logits.view(groups, -1)[g].max())
            eta = min(1.0, 100.0 / worst)
            want_q, want_k = w0[g, :q] * eta ** 0.5, w0[g, q:q + d] * eta ** 0.5
            results.append({"layer": i, "group": g, "max": worst, "clipped": eta < 1,
                            "q": float((w1[g, :q] - want_q).abs().max()),
                            "k": float((w1[g, q:q + d] - want_k).abs().max()),
                            "v": float((w1[g, q + d:] - w0[g, q + d:]).abs().max()),
                            "changed": bool((w1[g] != w0[g]).any())})
    with open(out, "w") as f:
        json.dump({"max_logit": top, "groups": results}, f)
    return 0


def switch(cases_file: str, out: str) -> int:
    """train() per case; a case marked "refused" must end with a CheckpointError, whose message is recorded."""
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.config import load_config
    from pretrain.train import train

    results = []
    for case in json.loads(open(cases_file).read()):
        try:
            train(load_config(case["config"], case["overrides"]))
            results.append(None)
        except CheckpointError as exc:
            if not case.get("refused"):
                raise
            results.append(str(exc))
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pretrain import compat
    from pretrain.run.runtime import init_distributed, shutdown

    compat.apply()
    if argv[0] == "switch":
        return switch(argv[1], argv[2])
    init_distributed()
    try:
        return qk_clip(argv[1]) if argv[0] == "qk_clip" else reference(argv[1])
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
