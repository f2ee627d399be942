"""Training data on Megatron-Core datasets: `GPTDataset` blends through `BlendedMegatronDatasetBuilder`,
or `MockGPTDataset` for synthetic tokens, read in Megatron's sample order.

Global batch `step` holds samples [step·GBS, (step+1)·GBS). Microbatch j of data-parallel rank d holds
samples (j·DP + d)·MBS … +MBS of it (Megatron's pretraining sampler order), so `consumed_samples` is the
whole data position and every layout sees the same global batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.data_check import parse_blend, uses_mock, uses_null_tokenizer


class DataError(RuntimeError):
    """Training data that cannot be used as read (e.g. a token id outside the model's vocabulary)."""


def build_tokenizer(data_cfg, vocab_size: int | None = None):
    """The run's tokenizer: the named files, the embedded Mistral / GPT-2 files when no path is given, or for mock
    data of a type that embeds none a null tokenizer of `vocab_size` (model.vocab_size) ids."""
    if uses_null_tokenizer(data_cfg):
        from pretrain.tokenizer.null import null_tokenizer
        from pretrain.tokenizer.types import TokenizerError

        if vocab_size is None:
            raise TokenizerError(f"mock data with data.tokenizer_type={data_cfg.tokenizer_type} and no tokenizer "
                                 "file uses a null tokenizer, which needs model.vocab_size")
        return null_tokenizer(vocab_size)
    from pretrain.tokenizer.load import run_tokenizer

    return run_tokenizer(data_cfg)


def _blend(items: list | None):
    return parse_blend(items) if items else None


def data_cache_dir(cfg) -> str:
    """Where Megatron's dataset index caches go: data.cache_dir, else run.dir/data_cache."""
    return cfg.data.cache_dir or os.path.join(cfg.run.dir, "data_cache")


def build_datasets(cfg, tokenizer, num_train_samples: int, num_eval_samples: int = 0):
    """(train, valid) datasets sized for the run; valid is None without evaluation.

    Every split gets a size (Megatron-Core needs one for weighted blends; 0 for a split the run never reads)
    and the splits the run does not read are left out of the split matrix, so Megatron-Core never builds
    them (it loops forever on a split that holds no documents). Pre-flight validation has checked that the
    splits read hold tokens.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    d = cfg.data
    mock = uses_mock(d)
    cache = data_cache_dir(cfg)
    Path(cache).mkdir(parents=True, exist_ok=True)
    per_split = None
    if d.train_blend and not mock:
        per_split = [_blend(d.train_blend), _blend(d.valid_blend) if num_eval_samples else None, None]
    ds_config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.model.seq_length,
        blend=None if (mock or per_split) else _blend(d.blend),
        blend_per_split=per_split,
        split=None if per_split else d.split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=d.reset_attention_mask,  # the per-document mask; else attention is causal
        mmap_bin_files=True,
    )
    if per_split is None:
        train_range, valid_range, _ = ds_config.split_matrix
        ds_config.split_matrix = [train_range, valid_range if num_eval_samples else None, None]
    cls = MockGPTDataset if mock else GPTDataset
    sizes = [num_train_samples, num_eval_samples, 0]
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, ds_config).build()
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


def microbatches(dataset, start_sample: int, *, num_microbatches: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device,
                 vocab_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches of the global batch starting at `start_sample`."""
    out = []
    for j in range(num_microbatches):
        first = start_sample + (j * dp_size + dp_rank) * micro_batch_size
        samples = [dataset[first + i] for i in range(micro_batch_size)]
        _check_ids(samples, first, vocab_size)
        # tokens, labels, loss_mask, position_ids (and attention_mask with data.reset_attention_mask); a
        # blend's samples also carry their dataset's index (a numpy integer), which the model does not read
        batch = {k: torch.stack([s[k] for s in samples]).to(device) for k, v in samples[0].items()
                 if torch.is_tensor(v)}
        out.append(batch)
    return out


def checked_microbatches(dataset, start_sample: int, *, vocab_size: int | None, device: torch.device,
                         **kwargs) -> list[dict[str, torch.Tensor]]:
    """`microbatches` with every token id checked against `vocab_size` (None: no check). All ranks agree:
    when one reads a bad id, every rank raises `DataError` (no rank is left waiting in a collective)."""
    if vocab_size is None:
        return microbatches(dataset, start_sample, device=device, **kwargs)
    bad, batches = None, []
    try:
        batches = microbatches(dataset, start_sample, device=device, vocab_size=vocab_size, **kwargs)
    except DataError as exc:
        bad = str(exc)
    flag = torch.tensor([1.0 if bad else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        raise DataError(bad or "another rank read a token id outside the model's vocabulary")
    return batches
