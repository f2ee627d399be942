"""One training step's mechanics on Megatron-Core, for the loop in `pretrain.train`: a microbatch's forward step and
loss, a global batch through Megatron's forward/backward schedule (`microbatch_runner`: the run's batches, packed
documents), the loss reduced over data parallel and known on every pipeline stage, the gradients' finiteness, the
validation loss, and the rank that writes metrics."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from pretrain.compat import mcore


class TrainingStopped(RuntimeError):
    """The run stopped on purpose with a message for the user (e.g. NaN loss with nan_policy=stop). `every_rank`:
    every rank stops with these words (the loss and grad norm are the same on all ranks): rank 0 prints them."""

    def __init__(self, message: str, every_rank: bool = True):
        super().__init__(message)
        self.every_rank = every_rank


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses under the mask, the token count, and both for logging."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm_loss": report}


def forward_step(data_iterator, model):
    """One microbatch through one model chunk (Megatron-Core schedule callback).

    Packed documents (THD, `pretrain.data.datasets.pack_documents`) arrive already cut to this CP rank; other
    batches are cut here (a copy: interleaved model chunks read the same microbatch)."""
    batch = next(data_iterator)
    packed = batch.get("packed_seq_params")
    if packed is None:
        batch = mcore.cp_batch(dict(batch))
    unwrapped = model
    while hasattr(unwrapped, "module"):  # DDP → GPTModel; Megatron-FSDP: adapter → MegatronFSDP → GPTModel
        unwrapped = unwrapped.module
    pre, post = unwrapped.pre_process, unwrapped.post_process
    tokens = pre or getattr(unwrapped, "mtp_process", False)  # MTP embeds the next tokens on its (last) stage
    output = model(
        batch["tokens"] if tokens else None,
        batch["position_ids"] if tokens else None,
        None,  # causal attention; document boundaries travel as packed_seq_params (needed on every stage)
        labels=batch["labels"] if post else None,
        packed_seq_params=packed,
    )
    return output, partial(lm_loss, batch["loss_mask"])


def reduce_loss(losses_reduced: list[dict]) -> float:
    """Per-token loss over the whole global batch (summed over microbatches, DP and CP)."""
    from megatron.core import parallel_state

    if not losses_reduced:
        return float("nan")
    total = torch.stack([x["lm_loss"] for x in losses_reduced]).sum(dim=0).double()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1].clamp(min=1)).item()


def grads_are_finite(model) -> bool:
    """True when every local gradient in the DDP grad buffers is finite."""
    ok = all(bool(torch.isfinite(b.grad_data).all()) for chunk in model for b in chunk.buffers)
    flag = torch.tensor([0.0 if ok else 1.0])
    if torch.cuda.is_available():
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def log0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def holds_the_loss() -> bool:
    """The one rank that writes metrics: last pipeline stage, first TP/CP/DP rank."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


def broadcast_from_last_stage(value: float, device: torch.device) -> float:
    """Make the loss known on every rank (PP stages other than the last have none)."""
    from megatron.core import parallel_state as ps

    t = torch.tensor([value if ps.is_pipeline_last_stage(ignore_virtual=True) else 0.0],
                     dtype=torch.float64, device=device)
    last = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast(t, src=last, group=ps.get_pipeline_model_parallel_group())
    return t.item()


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def microbatch_runner(run):
    """`run_microbatches(start_sample, forward_only, dataset, n=None) -> losses`: one global batch (`n` microbatches,
    else the step's: `run.num_microbatches`) through Megatron's forward/backward schedule (every batch checked when
    some dataset's ids could not be checked up front)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pretrain.data.datasets import DataError, checked_microbatches

    forward_backward = run.profiler.wrap("forward_backward", get_forward_backward_func())
    load_microbatches = run.profiler.wrap("data", run.timing.wrap("data", checked_microbatches))
    lay, model, seq_length = run.layout, run.model, run.plan.model.config.seq_length
    packing = document_packing(run.plan.model.packed_documents, run)
    # Packed documents are one sequence of micro_batch_size × seq_length tokens (padded under CP: then
    # pipeline stages exchange shapes, `variable_seq_lengths`).
    seq, mbs = (seq_length * lay.mbs, 1) if packing else (seq_length, lay.mbs)

    def run_microbatches(start_sample: int, forward_only: bool, dataset, n: int | None = None) -> list:
        n = n or run.num_microbatches
        try:
            batches = load_microbatches(
                dataset, start_sample, num_microbatches=n, micro_batch_size=lay.mbs,
                dp_rank=run.dp_rank, dp_size=lay.dp, device=run.rt.device, tp_source=run.tp_source,
                vocab_size=lay.vocab_size if run.problems.ids_unchecked else None, packing=packing)
        except DataError as exc:
            raise TrainingStopped(f"{exc}. The last checkpoint is intact.", every_rank=False) from None
        iterators = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
        return forward_backward(forward_step_func=forward_step, data_iterator=iterators, model=model,
                                num_microbatches=n, seq_length=seq, micro_batch_size=mbs,
                                forward_only=forward_only)

    return run_microbatches


def document_packing(packed: bool, run):
    """`pretrain.data.datasets.DocumentPacking` of this rank when microbatches are packed documents (`packed`:
    data.reset_attention_mask), else None."""
    from megatron.core import parallel_state as ps

    from pretrain.data.datasets import DocumentPacking

    if not packed:
        return None
    lay = run.layout
    return DocumentPacking(eod=run.tokenizer.eod, cp=lay.cp, cp_rank=ps.get_context_parallel_rank(),
                           sp_tp=lay.tp if lay.sp else 1)


def evaluate(t, run_microbatches, valid_ds, step: int, writer, device) -> float:
    """Mean per-token validation loss over train.eval_iters global batches (`t`: the train section)."""
    from megatron.core import parallel_state as ps

    eval_index = step // t.eval_interval - 1
    total = 0.0
    with torch.no_grad():
        for i in range(t.eval_iters):
            start = (eval_index * t.eval_iters + i) * t.global_batch_size
            losses = run_microbatches(start, True, valid_ds)
            total += broadcast_from_last_stage(reduce_loss(losses) if losses else 0.0, device)
    value = total / t.eval_iters
    if writer is not None:
        writer.write({"step": step, "valid_loss": value})
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        log0(f"[pretrain] step {step}: validation loss {value:.6f}")
    return value
