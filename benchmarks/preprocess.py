"""Preprocess throughput vs the raw batched tokenizer on the same cores (figures printed, not a test).

usage: python benchmarks/preprocess.py CORPUS.jsonl [--workers 2] [--repeat 3] [--reference]

For each tokenizer:
* raw = the encoder ``preprocess`` picks (gigatoken when it reproduces the reference ids), fresh,
  warmed on 200 documents, encoding the corpus's texts already in memory in 20,000-document batches
  (no I/O, no JSON parsing) -- the practical limit. ``--reference`` also times the reference
  library (sentencepiece / HF tokenizers) the same way.
* preprocess = the whole ``python -m data_tools preprocess`` command in a child process. Its
  summary line splits the wall time: processing = tokenizer ready -> outputs in place (reading
  and JSON parsing start earlier, during start-up, at most two batches ahead); start-up = the
  rest of the wall time (interpreter, imports, tokenizer load and id probe).

The machine may be shared: the load average is printed before and after, each figure is the best
of ``--repeat`` runs (raw and preprocess interleaved), and CPU seconds (user + sys, all threads)
are printed next to wall times because they are far less sensitive to other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER  # noqa: E402

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
_SPLIT = re.compile(r"start-up ([\d.]+) s \+ processing ([\d.]+) s \([\d.]+ MB/s, ([\d.]+) CPU-s")


def raw_throughput(corpus: Path, cli: list[str], workers: int, engine: str) -> dict:
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
t, c = time.perf_counter(), time.process_time()
for i in range(0, len(texts), 20000):
    enc.encode(texts[i:i + 20000])
wall, cpu = time.perf_counter() - t, time.process_time() - c
print(json.dumps({{'mb_s': n / 1e6 / wall, 'wall_s': wall, 'cpu_s': cpu, 'name': enc.name}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
        out_f, err_f = open(f"{d}/stdout", "w+b"), open(f"{d}/stderr", "w+b")
        t = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(child.pid, 0)  # rusage of this child only
        wall = time.perf_counter() - t
        out_f.seek(0), err_f.seek(0)
        out, err = out_f.read().decode(), err_f.read().decode()
        out_f.close(), err_f.close()
        if status != 0:
            raise SystemExit(f"preprocess failed: {err}")
    m = _SPLIT.search(out)
    if m is None:
        raise SystemExit(f"no start-up/processing split in the summary:\n{out}")
    return {
        "wall_s": wall,
        "processing_s": float(m.group(2)),
        "processing_cpu_s": float(m.group(3)),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
        "cmd": " ".join(cmd),
    }


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is shown")
    ap.add_argument("--reference", action="store_true", help="also time the reference library (slow)")
    ap.add_argument("--only", choices=sorted(TOKENIZERS), help="one tokenizer only")
    args = ap.parse_args()
    mb = args.corpus.stat().st_size / 1e6
    print(f"corpus {args.corpus} ({mb:.1f} MB), {args.workers} workers, {os.cpu_count()} CPUs")
    print(f"load average before: {_load()}")
    for name, cli in TOKENIZERS.items():
        if args.only and name != args.only:
            continue
        raws, pps = [], []
        for _ in range(args.repeat):
            raws.append(raw_throughput(args.corpus, cli, args.workers, "auto"))
            pps.append(run_preprocess(args.corpus, cli, args.workers))
        raw = max(raws, key=lambda r: r["mb_s"])
        pp = min(pps, key=lambda r: r["wall_s"])
        pp_cpu = min(r["cpu_s"] for r in pps)
        proc_cpu = min(r["processing_cpu_s"] for r in pps)
        raw_cpu = min(r["cpu_s"] for r in raws)
        proc_mb_s = mb / pp["processing_s"]
        startup = pp["wall_s"] - pp["processing_s"]
        print(f"{name}: input {mb:.1f} MB (best of {args.repeat}; load average now {_load()})")
        if args.reference:
            ref = raw_throughput(args.corpus, cli, args.workers, "reference")
            print(f"  raw {ref['name']} batch: {ref['mb_s']:.1f} MB/s")
        print(f"  raw {raw['name']} batch:   {raw['mb_s']:6.1f} MB/s")
        print(
            f"  preprocess processing: {proc_mb_s:6.1f} MB/s  = {100 * proc_mb_s / raw['mb_s']:.0f}% of raw "
            f"({pp['processing_s']:.2f} s)"
        )
        print(
            f"  CPU: raw {raw_cpu:.2f} CPU-s, preprocess processing {proc_cpu:.2f} CPU-s "
            f"(raw/processing = {100 * raw_cpu / proc_cpu:.0f}%: the wall ratio on idle cores when CPU-bound)"
        )
        print(
            f"  whole command: {pp['wall_s']:.2f} s wall = start-up {startup:.2f} s + processing "
            f"{pp['processing_s']:.2f} s; {mb / pp['wall_s']:.1f} MB/s; {pp_cpu:.2f} CPU-s; "
            f"peak RSS {max(r['peak_rss_mb'] for r in pps):.0f} MB"
        )
        print(f"  cmd: {pp['cmd']}")
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
