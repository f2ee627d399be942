"""What checking Megatron's index cache entries against their digests costs (`pretrain/data/cache.py`).

    python benchmarks/index_cache_digests.py [--samples 100000000] [--dir DIR]

Writes one GPTDataset-like entry (document, sample and shuffle indices: ≈ 17 bytes per sample) into DIR, then
times: recording its digests (what rank 0 does after a build), checking it when unchanged since its last check
(a `stat` per array), checking it after a change (every array's CRC-32 read again), and the checks without
digests (the `.npy` headers and 4,096 sampled elements per array).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.data import cache  # noqa: E402

BASE = "0123abcd-GPTDataset-train"


def _entry(d: Path, samples: int) -> list[Path]:
    (d / f"{BASE}{cache.DESCRIPTION}").write_text("benchmark entry\n")
    np.save(d / f"{BASE}-document_index.npy", np.arange(samples // 2, dtype=np.int32))
    rows = np.zeros((samples + 1, 2), dtype=np.int32)
    rows[:, 0] = np.linspace(0, samples // 2 - 1, samples + 1).astype(np.int32)
    np.save(d / f"{BASE}-sample_index.npy", rows)
    del rows
    np.save(d / f"{BASE}-shuffle_index.npy", np.random.default_rng(0).permutation(samples).astype(np.int64))
    return [d / f"{BASE}-{a}" for a in cache.ARRAYS["GPTDataset"]]


def _timed(what: str, fn) -> None:
    t = time.perf_counter()
    out = fn()
    print(f"{what}: {time.perf_counter() - t:.2f} s ({out})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000_000)
    ap.add_argument("--dir", type=Path)
    args = ap.parse_args()
    d = args.dir or Path(tempfile.mkdtemp(prefix="index-cache-"))
    d.mkdir(parents=True, exist_ok=True)
    paths = _entry(d, args.samples)
    size = sum(p.stat().st_size for p in paths)
    print(f"entry of {size / 2**30:.2f} GiB in {d}; {cache.HASH_THREADS} hashing threads; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    _timed("digests recorded (after a build)", lambda: cache.record_digests(d))
    _timed("checked, unchanged since its last check", lambda: cache.check_entries(d) or "kept")
    for p in paths:
        os.chmod(p, 0o644)  # a new ctime: every array is read again
    _timed("checked after a change (every CRC read again)", lambda: cache.check_entries(d) or "kept")
    _timed("the checks without digests", lambda: [cache._incomplete(p) for p in paths] and cache._consistent(
        "GPTDataset", {a: np.load(p, mmap_mode="r") for a, p in zip(cache.ARRAYS["GPTDataset"], paths)}))
    print(f"load {os.getloadavg()[0]:.1f}")
    if args.dir is None:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


if __name__ == "__main__":
    main()
