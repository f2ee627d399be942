"""Megatron side of the HF bridge tests, in its own 1-rank gloo process:

    python convert_worker.py logits CKPT_DIR TOKENS.pt OUT.pt [CKPT_DIR TOKENS.pt OUT.pt ...]
    python convert_worker.py memory HF_DIR WORK_DIR

`logits` builds the checkpoint's model at TP1/PP1 from its run_config.yaml, loads the weights with the
trainer's `load_checkpoint(weights_only=True)` and saves the logits (true vocabulary columns only) on
TOKENS ([batch, seq] int64) to OUT.pt. `memory` imports HF_DIR to WORK_DIR/ckpt and exports it back to
WORK_DIR/back, printing the process's peak RSS after each as JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def megatron_logits(*jobs: str) -> None:
    """jobs: CKPT_DIR TOKENS.pt OUT.pt, repeated; all in this one process."""
    from model_providers.core.builder import build_model
    from pretrain import compat
    from pretrain.checkpoint.context import CheckpointContext
    from pretrain.checkpoint.format import read_saved_config, resolve_checkpoint
    from pretrain.checkpoint.load import load_checkpoint
    from pretrain.config import config_from_dict
    from pretrain.hf.readers import CheckpointReader
    from pretrain.run.runtime import init_distributed, init_model_parallel, shutdown
    from pretrain.run_plan import for_weights

    compat.apply()
    init_distributed()
    try:
        for ckpt_dir, tokens_file, out_file in zip(jobs[0::3], jobs[1::3], jobs[2::3]):
            path = resolve_checkpoint(ckpt_dir)
            tree = read_saved_config(path)
            tree["parallel"].update(tensor=1, pipeline=1, virtual_pipeline=None, context=1, sequence_parallel=False,
                                    expert=1, expert_tensor=None)
            rows = CheckpointReader(path).tensors["embedding.word_embeddings.weight"].size[0]
            tree["model"]["make_vocab_size_divisible_by"] = rows  # the stored padding, whatever TP wrote it
            tree["model"]["mtp_num_layers"] = None  # MTP layers do not change the logits (and need labels)
            tree["checkpoint"]["allow_dropped_weights"] = True  # ... so the checkpoint's MTP weights are left out
            tree["run"]["dir"] = str(Path(out_file).parent / "logits_run")  # their record: not in the checkpoint's
            cfg = config_from_dict(tree)
            plan = for_weights(cfg, 1)
            vocab = plan.layout.vocab_size
            init_model_parallel(plan.layout, cfg.train.seed)
            model = build_model(plan.model, plan.layout)
            load_checkpoint(CheckpointContext(model, None, None, plan), path, weights_only=True)
            tokens = torch.load(tokens_file, weights_only=True)
            positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            model[0].eval()
            with torch.no_grad():
                logits = model[0](tokens, positions, None)
            torch.save(logits[..., :vocab].float().contiguous(), out_file)
    finally:
        shutdown()


def memory(hf_dir: str, work: str) -> None:
    import json

    from pretrain.hf.export import export_to_hf
    from pretrain.hf.files import peak_rss_bytes
    from pretrain.hf.hf_import import import_from_hf

    import_from_hf(hf_dir, f"{work}/ckpt", progress=False)
    after_import = peak_rss_bytes()
    export_to_hf(f"{work}/ckpt", f"{work}/back", tokenizer=hf_dir, progress=False)
    print(json.dumps({"from_hf": after_import, "both": peak_rss_bytes()}))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "logits":
        megatron_logits(*argv[1:])
    elif argv[0] == "memory":
        memory(*argv[1:3])
    else:
        raise SystemExit(f"unknown command {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
