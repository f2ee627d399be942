"""Training data on Megatron-Core datasets: `GPTDataset` blends through `BlendedMegatronDatasetBuilder`,
or `MockGPTDataset` for synthetic tokens, read in Megatron's sample order.

Global batch `step` holds samples [step·GBS, (step+1)·GBS). Microbatch j of data-parallel rank d holds
samples (j·DP + d)·MBS … +MBS of it (Megatron's pretraining sampler order), so `consumed_samples` is the
whole data position and every layout sees the same global batch.

With document boundaries (`data.reset_attention_mask`) a microbatch becomes packed sequences in THD form
(`pack_documents`): its documents one after another, described by `cu_seqlens` built from the EOD positions,
each padded to a multiple of 2×CP under context parallelism and cut to this CP rank's tokens. Transformer Engine
attention (GPU) and `model_providers.core.cp_attention` (the local spec) read the same `PackedSeqParams`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


class DataError(RuntimeError):
    """Training data that cannot be used as read (e.g. a token id outside the model's vocabulary)."""


def check_data_files_once(plan, device=None) -> None:
    """The dataset-file part of pre-flight validation (`pretrain.data.check.check_data_files`: files, index,
    `.bin` size, largest id, tokenizer identity) of the run plan `plan` (its data, tokenizer and model section) on
    rank 0 only; its verdict (errors, warnings, notes) is broadcast and added to every rank's `plan.problems`, so
    one process opens the files instead of all of them."""
    from pretrain.data.check import check_data_files
    from pretrain.problems import Report

    report = plan.problems
    verdict, failure = None, None
    if dist.get_rank() == 0:
        verdict = Report(report.world_size)
        try:
            check_data_files(plan.data, plan.tokenizer, plan.cfg.model, verdict)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks got a verdict
            failure = exc
            verdict.error("data.blend", f"the dataset check failed on rank 0: {exc}", "see rank 0's traceback")
    pending = verdict.data_verdicts if verdict is not None else []
    if verdict is not None:
        verdict.data_verdicts = []  # kept on rank 0, which writes them once the run's validation passed
    box = [verdict]
    dist.broadcast_object_list(box, src=0, device=device)
    if failure is not None:
        raise failure
    verdict = box[0]
    report.errors += verdict.errors
    report.warnings += verdict.warnings
    report.notes += [f"{n} (on rank 0, shared with every rank)" if n.startswith("dataset files checked") else n
                     for n in verdict.notes]
    report.ids_unchecked = report.ids_unchecked or verdict.ids_unchecked
    report.data_verdicts += pending


def _report_cache(log, cache: str, seconds: float, before, removed: list[str], built: bool = True,
                  checked_s: float = 0.0) -> None:
    """The removed cache entries and (`built`) what the build wrote or read (`checked_s`: the entries' checks)."""
    from pretrain.data.cache import CacheState

    for name in removed:
        log(f"[pretrain] data: removed the index cache entry {name}; rebuilding it")
    if not built:
        return
    files, size = CacheState.read(cache).added_since(before)
    if files:
        log(f"[pretrain] data: Megatron's dataset indices built in {seconds:.2f} s by rank 0 and cached in {cache} "
            f"({files} files, {size / 2**20:,.1f} MiB); the other ranks that read data, and later starts, "
            "read them")
    else:
        log(f"[pretrain] data: Megatron's dataset indices read from the cache in {cache} in {seconds:.2f} s "
            f"(built by an earlier start, checked against the digests recorded then in {checked_s:.2f} s; nothing "
            "rebuilt)")


def megatron_dataset_config(data, tokenizer, num_eval_samples: int = 0):
    """(dataset class, `GPTDatasetConfig`) of the data plan `data` (`pretrain.data.plan.DataPlan`), exactly as
    `build_datasets` hands them to Megatron-Core's `BlendedMegatronDatasetBuilder` (benchmarks/data_startup.py builds
    with them directly: Megatron's own cost).

    The splits the run does not read are left out of the split matrix, so Megatron-Core never builds them (it
    loops forever on a split that holds no documents)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    from model_providers.core.knobs import DATASET, mcore_kwargs

    blends, mock = data.blends, data.mock
    per_split = None
    if "data.train_blend" in blends:
        per_split = [blends["data.train_blend"], blends.get("data.valid_blend") if num_eval_samples else None, None]
    ds_config = GPTDatasetConfig(
        random_seed=data.seed,
        sequence_length=data.seq_length,
        blend=None if (mock or per_split) else blends.get("data.blend"),
        blend_per_split=per_split,
        split=None if per_split else data.split,
        path_to_cache=data.cache_dir,
        tokenizer=tokenizer,
        **mcore_kwargs(data.config, DATASET),  # the data section's fields declared mcore=DATASET (document options)
        create_attention_mask=False,  # documents travel as packed sequences (pack_documents), never a dense mask
        mmap_bin_files=True,
    )
    if per_split is None:
        train_range, valid_range, _ = ds_config.split_matrix
        ds_config.split_matrix = [train_range, valid_range if num_eval_samples else None, None]
    return (MockGPTDataset if mock else GPTDataset), ds_config


def build_datasets(data, tokenizer, num_train_samples: int, num_eval_samples: int = 0, *,
                   is_built_on_rank=None, log=None):
    """(train, valid) datasets of the data plan `data` sized for the run; valid is None without evaluation (and
    both are None on a rank for which `is_built_on_rank()` is False: it receives its batches from one that reads
    them).

    Every split gets a size (Megatron-Core needs one for weighted blends; 0 for a split the run never reads).
    Pre-flight validation has checked that the splits read hold tokens. Megatron builds the index caches on
    rank 0 while the others wait at a barrier, then the others read them; a start that finds them reads them
    too. Truncated cache entries (a start killed while writing them) are removed first. `log`: told how long
    that took and where the cache is (rank 0).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    cache = data.cache_dir
    Path(cache).mkdir(parents=True, exist_ok=True)
    cls, ds_config = megatron_dataset_config(data, tokenizer, num_eval_samples)
    sizes = [num_train_samples, num_eval_samples, 0]
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:
        from pretrain.data.cache import CacheState, check_entries

        checking = time.perf_counter()
        removed = check_entries(cache)  # truncated, unreadable, inconsistent, or not matching their digests
        checked_s = time.perf_counter() - checking
        before = CacheState.read(cache)  # after the removal: a rebuilt entry counts as built
    started = time.perf_counter()
    builder = BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank or (lambda: True), ds_config)
    train, valid, _ = builder.build()
    if first:
        from pretrain.data.cache import record_digests

        record_digests(cache)  # of the entries this build wrote, checked by every later start before it reads them
    if first and log is not None:
        _report_cache(log, cache, time.perf_counter() - started, before, removed, built=not data.mock,
                      checked_s=checked_s)
    return train, valid


def _check_ids(samples: list[dict], first: int, vocab_size: int | None) -> None:
    """Token ids must index the model's vocabulary (the pre-flight check could not scan every dataset)."""
    if vocab_size is None:
        return
    for i, sample in enumerate(samples):
        top = int(sample["tokens"].max()), int(sample["labels"].max())
        if max(top) >= vocab_size:
            raise DataError(f"sample {first + i} holds token id {max(top)}, outside the model's vocabulary of "
                            f"{vocab_size} (data made with another tokenizer? check it with `python -m data_tools "
                            "verify PREFIX --tokenizer-type ...`)")


@dataclass(frozen=True)
class DocumentPacking:
    """How microbatches become packed sequences: the end-of-document token, the CP size and rank, and the TP size
    a CP rank's tokens must divide into under sequence parallelism (1 without it)."""

    eod: int
    cp: int = 1
    cp_rank: int = 0
    sp_tp: int = 1


def pack_documents(batch: dict[str, torch.Tensor], packing: DocumentPacking) -> dict:
    """A microbatch as packed sequences (THD) on this CP rank: `{tokens, labels, loss_mask, position_ids}` of
    shape [1, t/CP] and `packed_seq_params` (Megatron-Core `PackedSeqParams`, qkv_format "thd").

    Documents end after each EOD token of `tokens` (where Megatron's `reset_attention_mask` cuts), sample by
    sample. Under CP each document is padded to a multiple of 2×CP (Transformer Engine splits every document in
    2×CP chunks) and the last one further, so that a CP rank's tokens divide by TP under sequence parallelism;
    padding tokens have loss mask 0 and attend to nothing. `cu_seqlens_q` counts real tokens,
    `cu_seqlens_q_padded` padded ones; `max_seqlen_q` is the longest padded document (RoPE's table).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_providers.core.cp_layout import thd_partition_index

    tokens = batch["tokens"]
    rows, seq = tokens.shape
    lengths: list[int] = []
    for row in tokens.cpu():
        ends = [int(e) + 1 for e in (row == packing.eod).nonzero().flatten() if int(e) + 1 < seq]
        bounds = [0, *ends, seq]
        lengths += [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    cp = packing.cp
    multiple = 2 * cp if cp > 1 else 1
    padded = [-(-n // multiple) * multiple for n in lengths]
    while cp > 1 and sum(padded) % (cp * packing.sp_tp):  # a CP rank's share must split over SP ranks
        padded[-1] += multiple
    device = tokens.device
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0, *padded], dtype=torch.int32).cumsum(0).to(torch.int32)
    out: dict = {}
    if cp == 1:
        out = {k: v.reshape(1, -1) for k, v in batch.items() if k != "attention_mask"}
    else:
        starts = cu_padded[:-1].tolist()
        dest = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths)]).to(device)
        index = thd_partition_index(cu_padded, cp, packing.cp_rank).to(device)
        for key, value in batch.items():
            if key == "attention_mask":
                continue
            flat = value.new_zeros(int(cu_padded[-1]))
            flat[dest] = value.reshape(-1)
            out[key] = flat[index].unsqueeze(0)
    longest = max(padded)
    cu, cu_padded = cu.to(device), cu_padded.to(device)
    out["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                               cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                                               max_seqlen_q=longest, max_seqlen_kv=longest)
    return out


def microbatches(dataset, start_sample: int, *, num_microbatches: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device, vocab_size: int | None = None,
                 packing: DocumentPacking | None = None) -> list[dict]:
    """This data-parallel rank's microbatches of the global batch starting at `start_sample` (packed sequences on
    this CP rank with `packing`)."""
    out = []
    for j in range(num_microbatches):
        first = start_sample + (j * dp_size + dp_rank) * micro_batch_size
        samples = [dataset[first + i] for i in range(micro_batch_size)]
        _check_ids(samples, first, vocab_size)
        # tokens, labels, loss_mask, position_ids; a blend's samples also carry their dataset's index (a numpy
        # integer), which the model does not read
        batch = {k: torch.stack([s[k] for s in samples]).to(device) for k, v in samples[0].items()
                 if torch.is_tensor(v)}
        out.append(pack_documents(batch, packing) if packing is not None else batch)
    return out


def _from_tp_source(batches: list[dict] | None, tp_source: tuple, device: torch.device) -> list[dict]:
    """The reading rank's microbatches on every rank of its tensor-parallel group (the same inputs, one reader):
    their keys, shapes and dtypes in one object broadcast, then each tensor (bool as uint8: gloo has no bool)."""
    group, src = tp_source
    box = [[[(k, tuple(v.shape), v.dtype) for k, v in b.items()] for b in batches] if batches is not None else None]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    out = []
    for i, items in enumerate(box[0]):
        batch = {}
        for key, shape, dtype in items:
            mine = batches[i][key] if batches is not None else torch.empty(shape, dtype=dtype, device=device)
            wire = mine.to(torch.uint8) if dtype == torch.bool else mine
            dist.broadcast(wire, src=src, group=group)
            batch[key] = mine if batches is not None or dtype != torch.bool else wire.to(torch.bool)
        out.append(batch)
    return out


def checked_microbatches(dataset, start_sample: int, *, vocab_size: int | None, device: torch.device,
                         tp_source: tuple | None = None, **kwargs) -> list[dict[str, torch.Tensor]]:
    """`microbatches` with every token id checked against `vocab_size` (None: no check). All ranks agree:
    when one reads a bad id, every rank raises `DataError` (no rank is left waiting in a collective).

    `tp_source` (tensor-parallel group, global rank of its reader): with TP > 1 only that rank holds the
    datasets (`dataset` is None on the others) and sends its microbatches to the group, as Megatron-LM does."""
    packing = kwargs.pop("packing", None)  # packed after the TP broadcast: PackedSeqParams are not tensors
    bad, batches = None, []
    if dataset is not None:
        try:
            batches = microbatches(dataset, start_sample, device=device, vocab_size=vocab_size, **kwargs)
        except DataError as exc:
            bad = str(exc)
    if vocab_size is not None:
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            raise DataError(bad or "another rank read a token id outside the model's vocabulary")
    if tp_source is not None:
        batches = _from_tp_source(batches if dataset is not None else None, tp_source, device)
    return [pack_documents(b, packing) for b in batches] if packing is not None else batches
