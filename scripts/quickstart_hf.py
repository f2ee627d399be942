"""Quickstart step 3: export a run's latest checkpoint to RUN_DIR/hf and generate with transformers.

    .venv/bin/python scripts/quickstart_hf.py RUN_DIR [--prompt TEXT] [--tokens N]

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
    ap.add_argument("--prompt", default="The Python standard library")
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args(argv)

    from data_tools.convert import export_to_hf
    from model_providers.core.mapping import ConversionError
    from pretrain.checkpointing import CheckpointError

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
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    new = out[0, inputs["input_ids"].shape[1]:]
    print(f"[quickstart_hf] {type(model).__name__} greedy continuation of {args.prompt!r} ({len(new)} tokens):")
    print(f"  ids:  {new.tolist()}")
    print(f"  text: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")
    print(f"[quickstart_hf] done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
