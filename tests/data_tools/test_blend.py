"""The trainer's path: Megatron-Core GPTDatasets blended over two preprocessed prefixes with weights."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from data_tools.preprocess import preprocess
from data_tools.tokenizers import load_tokenizer

from .conftest import SP_ARGS, corpus_texts, write_jsonl


@pytest.fixture
def gloo_group():
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_blended_gpt_datasets(tmp_path: Path, gloo_group: None) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    texts = corpus_texts(30, 4000)
    for name, part in (("a", texts[:15]), ("b", texts[15:])):
        preprocess(
            [str(write_jsonl(tmp_path / f"{name}.jsonl", part))], str(tmp_path / name), append_eod=True, **SP_ARGS
        )
    tok = load_tokenizer(**SP_ARGS)
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=64,
        blend=([str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")], [0.3, 0.7]),
        split="90,10,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
        mid_level_dataset_surplus=0.005,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, 0], lambda: True, config).build()
    assert len(train) >= 200 and len(valid) >= 20 and not test
    assert [round(w, 2) for w in train.weights] == [0.3, 0.7]
    counts = {0: 0, 1: 0}
    for i in range(200):
        counts[int(train.dataset_index[i])] += 1
        sample = train[i]
        assert sample["tokens"].shape[0] == 64 and int(sample["tokens"].max()) < tok.vocab_size
    assert abs(counts[1] / 200 - 0.7) < 0.05
