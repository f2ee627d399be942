"""HF bridge benchmark: export time and peak RSS for a ~1B-parameter random checkpoint, against the model's
size and against a plain safetensors copy of the same bytes.

    .venv/bin/python benchmarks/convert.py [--work /tmp/convert_bench] [--dtype bf16] [--layers 18]

Steps (each a separate process, measured with os.wait4: wall, CPU, peak RSS of that process alone):
  1. write a random Llama-shaped HF model (hidden 2048, GQA 16/8 heads, ffn 5632, vocab 32000), streamed
  2. from-hf: HF safetensors -> torch_dist checkpoint          (python -m data_tools convert from-hf)
  3. to-hf:   torch_dist checkpoint -> HF safetensors          (python -m data_tools convert to-hf)
  4. baseline: safetensors load_file + save_file of every shard (a plain copy through safetensors)
  5. baseline: cp of the same files (raw I/O)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

WRITE = """
import sys, torch
sys.path.insert(0, {root!r})
from transformers import LlamaConfig
from tests.data_tools.hf_random import write_random_hf
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers={layers},
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                  tie_word_embeddings=False, dtype={dtype!r})
print(write_random_hf({out!r}, cfg, max_shard_bytes=2 * 10**9))
"""

COPY = """
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for f in sorted(src.glob("*.safetensors")):
    save_file(load_file(str(f)), str(dst / f.name), metadata={"format": "pt"})
"""


def measure(cmd: list[str], label: str) -> dict:
    """Run `cmd`; wall seconds, CPU seconds and peak RSS of that process."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed ({proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    result = {"step": label, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
              "peak_rss_mb": usage.ru_maxrss / 1024, "stdout": out.strip().splitlines()[-1:] if out.strip() else []}
    print(f"{label:>24}: wall {wall:7.1f} s  cpu {result['cpu_s']:7.1f} s  peak RSS {result['peak_rss_mb']:7.0f} MB",
          flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/convert_bench")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--layers", type=int, default=18, help="18 layers: 0.98B parameters")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf, ckpt, back = work / "hf", work / "ckpt", work / "back"
    results = [measure([PY, "-c", WRITE.format(root=str(ROOT), layers=args.layers, dtype=args.dtype, out=str(hf))],
                       "write random HF model")]
    model_bytes = int(results[0]["stdout"][0])
    results.append(measure([PY, "-m", "data_tools", "convert", "from-hf", "--hf", str(hf), "--output", str(ckpt),
                            "--no-progress"], "from-hf"))
    results.append(measure([PY, "-m", "data_tools", "convert", "to-hf", "--checkpoint", str(ckpt), "--output",
                            str(back), "--no-progress", "--max-shard-gb", "2"], "to-hf"))
    results.append(measure([PY, "-c", COPY, str(hf), str(work / "copy")], "safetensors load+save"))
    results.append(measure(["bash", "-c", f"cp -r {hf} {work / 'cp'} && sync"], "cp + sync"))
    baseline = measure([PY, "-c", "import data_tools.convert, transformers.models.llama, model_providers.core.builder"],
                       "imports only")
    params = model_bytes // (2 if args.dtype == "bfloat16" else 4)
    largest = 32000 * 2048 * (2 if args.dtype == "bfloat16" else 4)
    summary = {"parameters": params, "model_bytes": model_bytes, "largest_tensor_bytes": largest,
               "import_rss_mb": baseline["peak_rss_mb"], "steps": results}
    print(json.dumps(summary, indent=1))
    print(f"\nmodel {params / 1e9:.2f} B parameters, {model_bytes / 1e9:.2f} GB ({args.dtype}); largest tensor "
          f"{largest / 1e6:.0f} MB; interpreter + imports {baseline['peak_rss_mb']:.0f} MB")
    for r in results[1:]:
        print(f"  {r['step']:>22}: {model_bytes / 1e9 / r['wall_s']:.3f} GB/s wall, "
              f"RSS {r['peak_rss_mb']:.0f} MB = {r['peak_rss_mb'] * 2**20 / model_bytes:.2f} × model")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
