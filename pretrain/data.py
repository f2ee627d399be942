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

from data_tools.assets import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

_SENTENCEPIECE_TYPES = {"sentencepiece", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"}
_GPT2_TYPES = {"GPT2BPETokenizer", "huggingface", "HuggingFaceTokenizer"}


def build_tokenizer(data_cfg):
    """The run's tokenizer via data_tools (embedded Mistral / GPT-2 files when no path is given)."""
    from data_tools.tokenizers import load_tokenizer

    ttype = data_cfg.tokenizer_type
    model, vocab, merges = data_cfg.tokenizer_model, data_cfg.vocab_file, data_cfg.merge_file
    if ttype in _SENTENCEPIECE_TYPES and model is None:
        model = str(MISTRAL_TOKENIZER)
    if ttype in _GPT2_TYPES and model is None and vocab is None:
        vocab, merges = str(GPT2_VOCAB), str(GPT2_MERGES)
        if ttype != "GPT2BPETokenizer":
            ttype = "GPT2BPETokenizer"
    return load_tokenizer(ttype, model, vocab_file=vocab, merge_file=merges)


def _blend(items: list | None):
    from megatron.core.datasets.utils import get_blend_from_list

    if not items:
        return None
    return get_blend_from_list([str(x) for x in items])


def data_cache_dir(cfg) -> str:
    """Where Megatron's dataset index caches go: data.cache_dir, else run.dir/data_cache."""
    return cfg.data.cache_dir or os.path.join(cfg.run.dir, "data_cache")


def build_datasets(cfg, tokenizer, num_train_samples: int, num_eval_samples: int = 0):
    """(train, valid) datasets sized for the run; valid is None without evaluation."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    d = cfg.data
    cache = data_cache_dir(cfg)
    Path(cache).mkdir(parents=True, exist_ok=True)
    per_split = None
    if d.train_blend:
        per_split = [_blend(d.train_blend), _blend(d.valid_blend), _blend(d.test_blend)]
    ds_config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.model.seq_length,
        blend=None if (d.mock or per_split) else _blend(d.blend),
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
    cls = MockGPTDataset if d.mock else GPTDataset
    # None: a split we never read (Megatron loops forever sizing a split that holds no documents).
    sizes = [num_train_samples, num_eval_samples or None, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, ds_config).build()
    return train, valid


def microbatches(dataset, start_sample: int, *, num_microbatches: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches of the global batch starting at `start_sample`."""
    out = []
    for j in range(num_microbatches):
        first = start_sample + (j * dp_size + dp_rank) * micro_batch_size
        samples = [dataset[first + i] for i in range(micro_batch_size)]
        # tokens, labels, loss_mask, position_ids (and attention_mask with data.reset_attention_mask)
        batch = {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}
        out.append(batch)
    return out
