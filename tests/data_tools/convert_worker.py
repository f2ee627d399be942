"""Megatron side of the HF bridge tests, in its own 1-rank gloo process:

    python convert_worker.py logits CKPT_DIR TOKENS.pt OUT.pt
    python convert_worker.py memory SMALL_HF BIG_HF WORK_DIR

`logits` builds the checkpoint's model at TP1/PP1 from its run_config.yaml, loads the weights with the
trainer's `load_checkpoint(weights_only=True)` and saves the logits (true vocabulary columns only) on
TOKENS ([batch, seq] int64) to OUT.pt. `memory` converts SMALL_HF both ways (warm-up: imports, tokenizer,
allocator), then BIG_HF, and prints JSON with the peak-RSS growth of each big conversion.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def megatron_logits(ckpt_dir: str, tokens_file: str, out_file: str) -> None:
    from data_tools.convert import CheckpointReader
    from model_providers.builder import build_model
    from pretrain import checkpointing
    from pretrain.config import config_from_dict
    from pretrain.data import build_tokenizer
    from pretrain.runtime import init_distributed, init_model_parallel, shutdown

    path = checkpointing.resolve_checkpoint(ckpt_dir)
    tree = checkpointing.read_saved_config(path)
    tree["parallel"].update(tensor=1, pipeline=1, virtual_pipeline=None, context=1, sequence_parallel=False)
    rows = CheckpointReader(path).tensors["embedding.word_embeddings.weight"].size[0]
    tree["model"]["make_vocab_size_divisible_by"] = rows  # the stored padding, whatever TP wrote it
    cfg = config_from_dict(tree)
    vocab = cfg.model.vocab_size or build_tokenizer(cfg.data).vocab_size
    init_distributed()
    try:
        init_model_parallel(cfg)
        model = build_model(cfg, vocab, on_gpu=False)
        checkpointing.load_checkpoint(cfg, model, None, None, path, weights_only=True)
        tokens = torch.load(tokens_file, weights_only=True)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        model[0].eval()
        with torch.no_grad():
            logits = model[0](tokens, positions, None)
        torch.save(logits[..., :vocab].float().contiguous(), out_file)
    finally:
        shutdown()


def memory(small_hf: str, big_hf: str, work: str) -> None:
    import json

    from data_tools.convert import export_to_hf, import_from_hf, peak_rss_bytes

    out = {}
    for name, hf in (("small", small_hf), ("big", big_hf)):
        before = peak_rss_bytes()
        import_from_hf(hf, f"{work}/{name}_ckpt", progress=False)
        grown_import = peak_rss_bytes() - before
        before = peak_rss_bytes()
        export_to_hf(f"{work}/{name}_ckpt", f"{work}/{name}_back", tokenizer=hf, progress=False)
        out[name] = {"from_hf": grown_import, "to_hf": peak_rss_bytes() - before, "peak": peak_rss_bytes()}
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "logits":
        megatron_logits(*sys.argv[2:5])
    elif sys.argv[1] == "memory":
        memory(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")
