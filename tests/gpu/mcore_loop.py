"""The baseline of tests/gpu/run.sh: the same model trained by a minimal loop that calls Megatron-Core directly.

    python tests/gpu/mcore_loop.py --layers 4 --hidden 4096 --ffn 14336 --heads 32 --groups 8 --vocab 128256 \\
        --seq 4096 --microbatches 4 --steps 8 --warmup 3 [--te] [--fp8 tensorwise] [--json-out F]

No config layer, no validation, no data pipeline (random tokens made once), no metrics: TransformerConfig
(with the fusions the trainer turns on on GPU), GPTModel, Megatron DDP, Megatron's Adam and the no-pipelining
forward/backward schedule, one rank. Its tokens/s against the trainer's gives the trainer's overhead.
`--cpu` runs it on CPU (tiny shapes, the project's CPU shims): a smoke test of these calls without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def build(args, on_gpu: bool):
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16
    softmax_kernels = all(importlib.util.find_spec(n) for n in ("scaled_masked_softmax_cuda",
                                                                "scaled_upper_triang_masked_softmax_cuda"))
    kwargs = dict(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.groups, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, params_dtype=dtype, pipeline_dtype=dtype, bf16=True,
        use_cpu_initialization=not on_gpu, bias_activation_fusion=on_gpu,
        masked_softmax_fusion=on_gpu and softmax_kernels, bias_dropout_fusion=on_gpu,
        apply_rope_fusion=on_gpu and args.te, cross_entropy_loss_fusion=on_gpu,
        gradient_accumulation_fusion=False, calculate_per_token_loss=True,
        transformer_impl="transformer_engine" if args.te else "local",
    )  # fmt: skip
    if args.fp8:
        kwargs.update(fp8="hybrid", fp8_recipe=args.fp8)
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_with_transformer_engine_spec() if args.te else get_gpt_layer_local_spec(
        normalization="RMSNorm")
    vocab = -(-args.vocab // 128) * 128
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=args.seq,
                     pre_process=True, post_process=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=500000)  # fmt: skip
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False,
                                               check_for_nan_in_grad=False)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-4, bf16=True, params_dtype=dtype,
                                                       clip_grad=1.0), [ddp])  # fmt: skip
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, optimizer, vocab


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("hidden", 4096), ("ffn", 14336), ("heads", 32), ("groups", 8),
                          ("vocab", 128256), ("seq", 4096), ("microbatches", 4), ("steps", 8), ("warmup", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--te", action="store_true", help="Transformer Engine spec")
    p.add_argument("--fp8", default=None, help="FP8 recipe (TE only)")
    p.add_argument("--cpu", action="store_true", help="smoke-run on CPU with the project's CPU shims")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from pretrain.compat.cpu_shims import apply_cpu_shims  # Megatron-Core's CUDA assumptions, on CPU only

        apply_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    if on_gpu:
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    ddp, optimizer, vocab = build(args, on_gpu)
    device = torch.device("cuda" if on_gpu else "cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=gen).to(device)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(args.seq, device=device).unsqueeze(0),
             "loss_mask": torch.ones(1, args.seq, device=device)}  # fmt: skip

    def loss_func(loss_mask, output):
        loss = (output.float().view(-1) * loss_mask.view(-1)).sum()
        tokens_n = loss_mask.sum().to(torch.int)
        return loss, tokens_n, {"lm loss": torch.stack([loss.detach(), tokens_n.detach().float()])}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, lambda output: loss_func(b["loss_mask"], output)

    fb = get_forward_backward_func()
    times, losses = [], []
    for _ in range(args.steps):
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = fb(forward_step_func=forward_step, data_iterator=iter([batch] * args.microbatches), model=[ddp],
                 num_microbatches=args.microbatches, seq_length=args.seq, micro_batch_size=1, forward_only=False)
        optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        total = torch.stack([x["lm loss"] for x in out]).sum(0)
        losses.append((total[0] / total[1]).item())
    steady = times[args.warmup:] or times
    step_s = statistics.mean(steady)
    result = {"tokens_per_s_per_gpu": args.microbatches * args.seq / step_s, "step_time_s": step_s,
              "loss_first": losses[0], "loss_last": losses[-1],
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None}  # fmt: skip
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result) + "\n")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
