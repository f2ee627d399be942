"""Preprocess throughput vs the raw batched tokenizer on the same cores (figures printed, not a test).

usage: python benchmarks/preprocess.py CORPUS.jsonl [--workers 2]
For each tokenizer: raw = the same encoder ``preprocess`` picks, on texts already in memory (no I/O);
preprocess = the whole ``python -m data_tools preprocess`` command (wall time, peak RSS of the child).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_tools.assets import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER  # noqa: E402

TOKENIZERS = {
    "gpt2-bpe": [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(GPT2_VOCAB),
        "--merge-file",
        str(GPT2_MERGES),
    ],
    "mistral-sp": ["--tokenizer-type", "sentencepiece", "--tokenizer-model", str(MISTRAL_TOKENIZER)],
}


def raw_throughput(corpus: Path, cli: list[str], workers: int, engine: str) -> tuple[float, str]:
    code = f"""
import json, os, sys, time
os.environ['RAYON_NUM_THREADS'] = '{workers}'
sys.path.insert(0, {str(ROOT)!r})
from data_tools.tokenizers import resolve_spec, build_batch_encoder
a = {cli!r}
kw = {{a[i].lstrip('-').replace('-', '_'): a[i + 1] for i in range(0, len(a), 2)}}
enc = build_batch_encoder(resolve_spec(**kw), {workers}, {engine!r})
texts = [json.loads(l)['text'] for l in open({str(corpus)!r}, encoding='utf-8')]
enc.encode(texts[:200])  # warm-up (first call is slower)
n = sum(len(t.encode()) for t in texts)
t = time.perf_counter()
for i in range(0, len(texts), 20000):
    enc.encode(texts[i:i + 20000])
print(json.dumps({{'mb_s': n / 1e6 / (time.perf_counter() - t), 'name': enc.name}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["mb_s"], r["name"]


def run_preprocess(corpus: Path, cli: list[str], workers: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            "-m",
            "data_tools",
            "preprocess",
            "--input",
            str(corpus),
            "--output-prefix",
            f"{d}/out",
            *cli,
            "--append-eod",
            "--workers",
            str(workers),
            "--no-progress",
        ]
        t = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t
        if status != 0:
            raise SystemExit(f"preprocess failed: {child.stderr.read().decode()}")
        rss = usage.ru_maxrss  # this child only (KiB on Linux)
    return {"wall_s": wall, "peak_rss_mb": rss / 1024, "cmd": " ".join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    mb = args.corpus.stat().st_size / 1e6
    for name, cli in TOKENIZERS.items():
        ref_mb_s, ref_name = raw_throughput(args.corpus, cli, args.workers, "reference")
        fast_mb_s, fast_name = raw_throughput(args.corpus, cli, args.workers, "auto")
        res = run_preprocess(args.corpus, cli, args.workers)
        pp_mb_s = mb / res["wall_s"]
        print(f"{name}: input {mb:.1f} MB")
        print(f"  raw {ref_name} batch: {ref_mb_s:.1f} MB/s; raw {fast_name} batch: {fast_mb_s:.1f} MB/s")
        print(
            f"  preprocess whole command: {res['wall_s']:.1f} s = {pp_mb_s:.1f} MB/s "
            f"({100 * pp_mb_s / fast_mb_s:.0f}% of raw {fast_name}), peak RSS {res['peak_rss_mb']:.0f} MB"
        )
        print(f"  cmd: {res['cmd']}")


if __name__ == "__main__":
    main()
