"""``python -m data_tools convert {to-hf,from-hf}``: the command line over the HF bridge in ``pretrain.hf``.

    python -m data_tools convert to-hf --checkpoint RUN_DIR_or_CKPT_DIR [--iteration N] --output HF_DIR
        [--dtype bf16|fp16|fp32] [--tokenizer PATH] [--overwrite] [--max-shard-gb G]
    python -m data_tools convert from-hf --hf HF_DIR --output CKPT_DIR [--config CONFIG] [--dtype ...]

to-hf converts a checkpoint saved at any TP/PP/VP layout the same way (``pretrain.hf.export``); from-hf
writes a torch_dist checkpoint the trainer loads at any layout (``pretrain.hf.hf_import``). Both stream one
tensor (or layer slice) at a time and write to a staging directory renamed into place only when complete.
"""

from __future__ import annotations

import argparse
import sys

from model_providers.core.mapping import ConversionError
from pretrain.hf.export import export_to_hf, plan_export
from pretrain.hf.files import DTYPES, peak_rss_bytes
from pretrain.hf.hf_import import import_from_hf
from pretrain.hf.readers import CheckpointReader, HFReader
from pretrain.hf.tokenizer import hf_tokenizer

__all__ = ["CheckpointReader", "ConversionError", "HFReader", "build_parser", "export_to_hf", "hf_tokenizer",
           "import_from_hf", "main", "peak_rss_bytes", "plan_export"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools convert",
                                     description="Megatron torch_dist checkpoints <-> HuggingFace transformers.")
    sub = parser.add_subparsers(dest="direction", required=True)
    p = sub.add_parser("to-hf", help="export a torch_dist checkpoint (any TP/PP/VP layout) to transformers")
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoints dir or iter_NNNNNNN dir")
    p.add_argument("--iteration", type=int, help="iteration to export (default: the latest)")
    p.add_argument("--output", required=True, help="HF model directory to create")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: as stored)")
    p.add_argument("--tokenizer", help="HF tokenizer dir / tokenizer.json / tokenizer.model (default: the imported "
                                       "HF model's files, else the run's tokenizer)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (default 5 GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("from-hf", help="import transformers safetensors weights as a torch_dist checkpoint")
    p.add_argument("--hf", required=True, help="transformers model directory (config.json + *.safetensors)")
    p.add_argument("--output", required=True, help="checkpoint directory to create (use as checkpoint.pretrained)")
    p.add_argument("--config", help="the training config to check the shape against (its parallel.tensor sets "
                                    "the vocabulary padding)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="stored dtype (default: as in the HF files)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of --config "
                                                                       "(e.g. parallel.tensor=2)")
    return parser


def _report(summary: dict, what: str) -> None:
    gb = summary["bytes"] / 1e9
    print(f"[convert] {what}: {summary['tensors']} tensors, {gb:.3f} GB in {summary['seconds']:.1f} s "
          f"({gb / max(summary['seconds'], 1e-9):.3f} GB/s), peak RSS {summary['peak_rss_bytes'] / 2**20:.0f} MiB "
          f"-> {summary['output']}", flush=True)


def _bad_number(args: argparse.Namespace) -> str | None:
    """The first numeric option out of range, as a message (None: all fine)."""
    shard, iteration = getattr(args, "max_shard_gb", None), getattr(args, "iteration", None)
    if shard is not None and not shard > 0:
        return f"--max-shard-gb {shard}: must be positive"
    if iteration is not None and iteration < 0:
        return f"--iteration {iteration}: must be at least 0"
    return None


def _train_from(summary: dict, hf_dir: str) -> None:
    """The line saying how to train from an import (and, without tokenizer files, that a tokenizer is needed)."""
    out, vocab, padded = summary["output"], summary["vocab_size"], summary["padded_vocab_size"]
    if summary["tokenizer"] == "none":
        print(f"[convert] note: {hf_dir} has no tokenizer files: the checkpoint records none (to-hf exports its "
              "weights and config.json only, as the directory was), and its run_config.yaml names no tokenizer of "
              "the model's", file=sys.stderr)
        print(f"[convert] train from it with: checkpoint.pretrained={out} data.tokenizer_type=TYPE "
              f"data.tokenizer_model=PATH (the model's tokenizer: at most {vocab:,} tokens; the embedded default "
              f"is refused unless it fits) (vocabulary padded to {padded})")
        return
    print(f"[convert] train from it with: checkpoint.pretrained={out} (vocabulary padded to {padded})")


def main(argv: list[str]) -> int:
    """`python -m data_tools convert ...`; returns the exit status."""
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.config import ConfigError
    from pretrain.run.output_lock import Held, OutputLocked, Target, hold

    args = build_parser().parse_args(argv)
    bad = _bad_number(args)
    if bad:
        print(f"[convert] error: {bad}", file=sys.stderr)
        return 1
    lock = Held([])
    try:
        lock = hold([Target(args.output, f"convert {args.direction} --output", create_parent=True)])  # one writer
        if args.direction == "to-hf":
            summary = export_to_hf(args.checkpoint, args.output, iteration=args.iteration, dtype=args.dtype,
                                   tokenizer=args.tokenizer, overwrite=args.overwrite,
                                   max_shard_bytes=int(args.max_shard_gb * 1e9), progress=not args.no_progress)
            _report(summary, "to-hf")
        else:
            summary = import_from_hf(args.hf, args.output, config=args.config, dtype=args.dtype,
                                     overrides=args.overrides, overwrite=args.overwrite,
                                     progress=not args.no_progress)
            for note in summary["notes"]:
                print(f"[convert] note: {note}", file=sys.stderr)
            _report(summary, "from-hf")
            _train_from(summary, args.hf)
        return 0
    except KeyboardInterrupt:
        print("\n[convert] interrupted; no output written", file=sys.stderr)
        return 130
    except (ConversionError, CheckpointError, ConfigError, OSError, OutputLocked) as exc:
        print(f"[convert] error: {exc}", file=sys.stderr)
        return 1
    finally:
        lock.release()
