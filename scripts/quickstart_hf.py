"""Quickstart step 3: export a run's latest checkpoint to RUN_DIR/hf and generate with transformers.

    .venv/bin/python scripts/quickstart_hf.py RUN_DIR [--prompt TEXT ...] [--tokens N] [--temperature T]

Text is sampled (temperature 0.7, top-p 0.9, repetition penalty 1.2, seed 0: the same text on every run
of the same model); `--temperature 0` decodes greedily. A small model decoded greedily tends to repeat its
most likely token (often a newline) forever; sampling shows what it learned.

The exported directory is a plain transformers model (no custom code): AutoModelForCausalLM and
AutoTokenizer load it directly.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--prompt", action="append", default=None,
                    help="prompt (repeatable; default: two openings in the corpus's style)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy decoding")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repetition-penalty", type=float, default=1.2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from model_providers.core.mapping import ConversionError
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.hf.export import export_to_hf

    started = time.perf_counter()
    hf_dir = Path(args.run_dir) / "hf"
    try:
        summary = export_to_hf(args.run_dir, hf_dir, overwrite=True, progress=False)
    except (ConversionError, CheckpointError, OSError) as exc:
        print(f"quickstart_hf: export failed: {exc}", file=sys.stderr)
        return 1
    print(f"[quickstart_hf] exported {summary['checkpoint']} -> {hf_dir} ({summary['tensors']} tensors, "
          f"{summary['bytes'] / 1e6:.1f} MB, {summary['seconds']:.1f} s)", flush=True)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.float32)
    model.eval()
    if args.temperature > 0:
        how = (f"sampled (temperature {args.temperature}, top-p {args.top_p}, repetition penalty "
               f"{args.repetition_penalty}, seed {args.seed})")
        decoding = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    else:
        how, decoding = f"greedy (repetition penalty {args.repetition_penalty})", {"do_sample": False}
    for prompt in args.prompt or ["The Python standard library", "The :mod:`os` module provides"]:
        inputs = tokenizer(prompt, return_tensors="pt")
        torch.manual_seed(args.seed)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.tokens, repetition_penalty=args.repetition_penalty,
                                 pad_token_id=tokenizer.eos_token_id, **decoding)
        new = out[0, inputs["input_ids"].shape[1]:]
        print(f"[quickstart_hf] {type(model).__name__}, {len(new)} tokens {how} after {prompt!r}:")
        print("  | " + tokenizer.decode(out[0], skip_special_tokens=True).replace("\n", "\n  | "))
    print(f"[quickstart_hf] done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
