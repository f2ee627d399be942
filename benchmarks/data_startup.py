"""Time to the first step and peak memory per rank vs corpus size: the trainer against Megatron-Core's own build.

    python benchmarks/data_startup.py [--sizes 1B,10B,100B,1T] [--prefixes 1,100,1000] [--layouts dp2,tp2]
        [--root DIR] [--seq 2048] [--keep] [--metadata with,without] [--validate-only] [--validate-checkouts A,B]

For each corpus size x prefix count it writes a synthetic blend (`make_prefix`: a real `.idx`, a sparse `.bin` made
with truncate, and PREFIX.meta.json; document lengths log-normal, median 900 tokens, sigma 1.0, mean ~1,480 —
the issue's 500 B tokens / 333 M documents; C4 has ~430 tokens per document, The Pile ~1,400), the blend weighted
by tokens. Then, per layout (2 ranks: DP2, or TP2 where only the first rank of the TP group reads data), cold
(an empty index cache) and warm (the cache of the cold start):

  ours     `torchrun --nproc-per-node 2 -m pretrain train tiny_llama data.blend=[...] train.steps=1 ...`: seconds from
           the launch to the first step's loss, the trainer's own data time (its log: pre-flight dataset check +
           index build), and the peak RSS of each rank (sampled from outside every 50 ms; VmHWM);
  floor    Megatron-Core alone: `BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()` with
           `pretrain.data.datasets.megatron_dataset_config` (the very config the trainer passes), under torchrun, timed
           between two barriers; its RSS growth over the pre-build RSS.

`--metadata without` writes the corpora without PREFIX.meta.json (as Megatron-LM's preprocess_data.py does): the
cold start reads every `.idx` in full, the warm one checks them from the verdict cache (`data.cache_dir`,
`pretrain.dataset_format.verdicts`). `validate` runs twice per corpus (cold, warm) against a cache directory of its
own, and twice on mock data first; its rows show the check line, which says how many prefixes came from metadata,
the verdict cache, a full read, and whether Megatron-Core's config checks ran or came from their verdict cache
(`pretrain.rules.megatron_verdicts`). `--validate-checkouts before,after` runs those from each checkout in turn, on
the same corpora.

The table: ours (data s), Megatron's (s), ratio, our overhead (s), the first-loss time, our peak RSS (max over
ranks) and its growth over a mock-data run, Megatron's growth. Timings are noisy on a shared machine: compare the
ratio, which divides out the load (both run in the same minutes). Disk: one corpus at a time (≈ 20 bytes per
document for the .idx, ≈ 12 bytes per sample for each cache), deleted after its rows unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MEDIAN_TOKENS, SIGMA = 900.0, 1.0  # log-normal document lengths (mean = median * exp(sigma^2 / 2) ≈ 1,484)
MAX_DOC_TOKENS = 1 << 20
CHUNK_DOCS = 1 << 24
SIZES = {"1B": 10**9, "10B": 10**10, "100B": 10**11, "1T": 10**12}
# One step of one sample per rank: the data figures do not depend on the batch (Megatron's indices cover an epoch).
TRAIN = ["train.steps=1", "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_interval=null",
         "checkpoint.interval=null", "checkpoint.save_at_end=false", "logging.tensorboard=false", "data.mock=false"]
_CHECK = re.compile(r"dataset files checked: (\d+) prefix\(es\) in ([\d.]+) s")
_CHECK_LINE = re.compile(r"dataset files checked: [^\n]*? read in full\)")
_MCORE_CACHED = "verdict from the cache"  # pretrain.rules.megatron's note
_BUILD = re.compile(r"indices (?:built|read from the cache in \S+) in ([\d.]+) s")


# --------------------------------------------------------------------------------------------------
# Synthetic corpora
# --------------------------------------------------------------------------------------------------
def _lengths(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Document lengths (int32) summing to exactly `tokens`."""
    out, total = [], 0
    while total < tokens:
        n = min(CHUNK_DOCS, int((tokens - total) / (MEDIAN_TOKENS * np.exp(SIGMA**2 / 2)) * 1.02) + 16)
        part = np.clip(rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, n), 1, MAX_DOC_TOKENS).astype(np.int32)
        cum = np.cumsum(part, dtype=np.int64) + total
        stop = int(np.searchsorted(cum, tokens))  # the document that reaches `tokens`
        if stop < n:
            part = part[: stop + 1].copy()
            part[-1] -= int(cum[stop] - tokens)
            part = part[part > 0]
        out.append(part)
        total += int(part.sum(dtype=np.int64))
    return np.concatenate(out)


def make_prefix(prefix: Path, tokens: int, seed: int, identity, meta: bool = True) -> int:
    """Write a uint16 dataset of `tokens` tokens at `prefix`: real .idx, sparse .bin, meta.json (`meta=False`:
    none, as Megatron-LM's preprocess_data.py writes). Returns docs."""
    from pretrain.dataset_format.indexed import _header_bytes
    from pretrain.dataset_format.metadata import commit_meta, dataset_record, write_meta_tmp

    lengths = _lengths(np.random.default_rng(seed), tokens)
    n = int(lengths.size)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_header_bytes(np.dtype(np.uint16), n, n + 1))
        f.write(lengths.tobytes())
        pointer = 0
        for s in range(0, n, CHUNK_DOCS):
            ends = np.cumsum(lengths[s:s + CHUNK_DOCS], dtype=np.int64) * 2 + pointer
            f.write(np.concatenate([[pointer], ends[:-1]]).astype(np.int64).tobytes())
            pointer = int(ends[-1])
        for s in range(0, n + 1, CHUNK_DOCS):
            f.write(np.arange(s, min(n + 1, s + CHUNK_DOCS), dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * 2)  # sparse: no disk used, reads as zeros
    if not meta:
        return n
    write_meta_tmp(prefix, dataset_record(
        tool="benchmarks/data_startup.py (synthetic)", tokenizer=identity, append_eod=True, dtype="uint16",
        documents=n, sequences=n, tokens=tokens, max_token_id=identity.vocab_size - 1, inputs=[]))
    commit_meta(prefix)
    return n


def make_blend(root: Path, tokens: int, prefixes: int, meta: bool = True) -> tuple[list, int]:
    """`prefixes` datasets of tokens/prefixes tokens each under root; (weighted blend items, documents)."""
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER
    from pretrain.tokenizer.identity import describe_tokenizer

    identity = describe_tokenizer("sentencepiece", str(MISTRAL_TOKENIZER))  # tiny_llama's embedded tokenizer
    root.mkdir(parents=True, exist_ok=True)
    items, docs = [], 0
    for i in range(prefixes):
        share = tokens // prefixes + (1 if i < tokens % prefixes else 0)
        prefix = root / f"shard{i:05d}_text_document"
        docs += make_prefix(prefix, share, seed=i, identity=identity, meta=meta)
        items += [share, str(prefix)]
    return items, docs


# --------------------------------------------------------------------------------------------------
# Runs (measured from outside: RSS of every rank sampled through /proc)
# --------------------------------------------------------------------------------------------------
def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def write_config(path: Path, blend: list) -> Path:
    """tiny_llama.yaml with `data.blend` set (a thousand prefixes do not fit in one command-line argument)."""
    import yaml

    tree = yaml.safe_load((REPO / "pretrain" / "configs" / "tiny_llama.yaml").read_text())
    tree["data"]["blend"] = blend
    path.write_text(yaml.safe_dump(tree))
    return path


CHECKOUT = [REPO]  # where the trainer runs from (--checkout: another one, e.g. an older commit)
VALIDATE_CHECKOUTS: list[Path] = []  # --validate-checkouts: validate from each of these (before / after)


def run_measured(cmd: list[str], log: Path, first_loss: Path | None = None, timeout: float = 7200,
                 checkout: Path | None = None) -> dict:
    """Run `cmd` (a torchrun, or one process: rank 0); seconds to exit and to `first_loss` (a metrics.jsonl line
    with a loss), and the per-rank peaks of VmHWM, VmRSS, RssAnon and RssFile."""
    checkout = checkout or REPO
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(checkout))
    started = time.perf_counter()
    peaks: dict[int, dict[str, int]] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            _sample(proc, peaks, first_loss, started, timeout, cmd, log)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    loss_at = peaks.pop(-1, {}).get("loss_at")
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{log.read_text()[-4000:]}")
    return {"wall_s": wall, "first_loss_s": loss_at, "peaks": peaks, "log": log.read_text()}


def _sample(proc, peaks: dict, first_loss: Path | None, started: float, timeout: float, cmd, log) -> None:
    """Until `proc` exits: every 50 ms the ranks' memory peaks and, once, the time of the first loss
    (stored as peaks[-1]["loss_at"])."""
    loss_at = None
    launcher = "torch.distributed.run" in cmd
    while proc.poll() is None:
        for pid in _children(proc.pid) if launcher else [proc.pid]:
            rank = _rank_of(pid) if launcher else 0
            if rank is None:
                continue
            st, peak = _status(pid), peaks.setdefault(rank, {})
            for k, v in st.items():
                peak[k] = max(peak.get(k, 0), v)
        if loss_at is None and first_loss is not None and first_loss.exists():
            if any('"loss"' in line for line in first_loss.read_text().splitlines()):
                loss_at = time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            raise SystemExit(f"timed out after {timeout:.0f} s: {' '.join(cmd)} (log {log})")
        time.sleep(0.05)
    peaks[-1] = {"loss_at": loss_at}


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]


def run_validate(config: str, overrides: list[str], log: Path, checkout: Path | None = None) -> dict:
    """`python -m pretrain validate CONFIG ... --world-size 2`: one process, as the Slurm launcher runs it."""
    return run_measured([sys.executable, "-m", "pretrain", "validate", config, *overrides, "--world-size", "2"], log,
                        checkout=checkout or CHECKOUT[0])


def validate_rows(config: str, overrides: list[str], cache: Path, log_stem: Path, row: dict) -> list[dict]:
    """For each checkout (`--validate-checkouts`), `run_validate` cold (an empty cache dir: every check runs, its
    verdicts are stored) then warm (that cache): one row each, with the wall time, peak RSS, the load average
    before, the data check line and whether Megatron-Core's checks came from their verdict cache."""
    out = []
    for checkout in VALIDATE_CHECKOUTS or [CHECKOUT[0]]:
        out += _validate_pair(config, overrides, cache, log_stem, {**row, "checkout": checkout.name}, checkout)
    return out


def _validate_pair(config: str, overrides: list[str], cache: Path, log_stem: Path, row: dict,
                   checkout: Path) -> list[dict]:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)  # validate writes verdicts only into a cache dir that exists
    out = []
    for state in ("cold", "warm"):
        load = os.getloadavg()[0]
        val = run_validate(config, [*overrides, f"data.cache_dir={cache}"],
                           Path(f"{log_stem}_{checkout.name}_{state}.log"), checkout)
        check = _CHECK_LINE.search(val["log"])
        out.append({**row, "state": state, "s": val["wall_s"], "load": load,
                    "rss": max((p.get("VmHWM", 0) for p in val["peaks"].values()), default=0),
                    "check": check.group(0) if check else "", "megatron_cached": _MCORE_CACHED in val["log"]})
        print(f"  validate {row['size']} {checkout.name} ({state}): {val['wall_s']:.2f} s, load {load:.1f}, peak RSS "
              f"{_gb(out[-1]['rss'])} GiB; Megatron-Core checks {'cached' if out[-1]['megatron_cached'] else 'run'}; "
              f"{out[-1]['check']}", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def run_ours(config: str, overrides: list[str], run_dir: Path, log: Path) -> dict:
    res = run_measured(_torchrun("-m", "pretrain", "train", config, *overrides, f"run.dir={run_dir}"), log,
                       first_loss=run_dir / "metrics.jsonl", checkout=CHECKOUT[0])
    check = _CHECK.search(res["log"])
    build = _BUILD.search(res["log"])
    res["check_s"] = float(check.group(2)) if check else 0.0
    res["build_s"] = float(build.group(1)) if build else 0.0
    res["data_s"] = res["check_s"] + res["build_s"]
    return res


def run_floor(config: str, overrides: list[str], tp: int, log: Path) -> dict:
    out = log.with_suffix(".json")
    res = run_measured(_torchrun(str(Path(__file__).resolve()), "_floor", str(out), str(tp), config, *overrides), log)
    res.update(json.loads(out.read_text()))
    return res


def floor_main(out: str, tp: int, config_path: str, overrides: list[str]) -> None:
    """Under torchrun: Megatron-Core's BlendedMegatronDatasetBuilder on the trainer's config, nothing else."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.data.datasets import megatron_dataset_config
    from pretrain.data.plan import data_plan
    from pretrain.tokenizer.load import run_tokenizer

    compat.apply(on_gpu=False)
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = load_config(config_path, overrides)
    cls, config = megatron_dataset_config(data_plan(cfg), run_tokenizer(cfg.data))
    Path(config.path_to_cache).mkdir(parents=True, exist_ok=True)
    reads = ps.get_tensor_model_parallel_rank() == 0
    before = _status(os.getpid()).get("VmRSS", 0)
    dist.barrier()
    t0 = time.perf_counter()
    BlendedMegatronDatasetBuilder(cls, [cfg.train.steps * cfg.train.global_batch_size, 0, 0], lambda: reads,
                                  config).build()
    dist.barrier()
    seconds = time.perf_counter() - t0
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, before)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"build_s": seconds, "rss_before": rss}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 2**30:.2f}"


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def estimate_bytes(docs: int, tokens: int, prefixes: int, seq: int, layout: str) -> int:
    """Anonymous memory Megatron's cold build needs (both ranks together), from gpt_dataset.py (0.16): every reading
    rank holds an int32 arange of each dataset's documents; the building rank keeps, per dataset, the document index
    (int32 per document), the sample index (two int32 per sample, int64 once a dataset has 2^31 tokens) and the
    shuffle index (uint32 per sample), and while building one dataset needs at most max(20 bytes per document: the
    int64 numpy.mgrid and its int32 copy, 8 per document + its sample and shuffle indices: the lengths copy). Plus
    ~0.8 GiB per process (torch and the model)."""
    readers = 2 if layout == "dp2" else 1
    n, s = docs / prefixes, tokens / prefixes / seq
    pair = 16 if tokens / prefixes >= 2**31 else 8
    kept = 4 * n + (pair + 4) * s  # what one built dataset keeps on the building rank
    builder = (prefixes - 1) * kept + 4 * n + max(20 * n, 8 * n + (pair + 4) * s)
    return int(builder + (readers - 1) * 4 * docs + 2 * 0.8 * 2**30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1B,10B,100B,1T", help=f"comma-separated, of {','.join(SIZES)} (or e.g. 300B)")
    ap.add_argument("--prefixes", default="1,100,1000")
    ap.add_argument("--layouts", default="dp2,tp2")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--root", type=Path, help="where the corpora and caches go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--checkout", type=Path, help="run the trainer from this checkout (e.g. an older commit: the "
                    "before figures); Megatron's floor always from this one")
    ap.add_argument("--max-gib", type=float, default=16.0, help="skip a layout whose cold build Megatron itself "
                    "needs more memory for (estimate_bytes; the machine may be shared)")
    ap.add_argument("--validate-only", action="store_true", help="only the corpora and `pretrain validate`")
    ap.add_argument("--validate-checkouts", default="", help="comma-separated checkouts to run `validate` from, "
                    "each on the same corpora (e.g. before,after); default: --checkout")
    ap.add_argument("--metadata", default="with", help="with,without: corpora with PREFIX.meta.json, and/or without "
                    "(as Megatron-LM's preprocess_data.py writes them: checked from the verdict cache when warm)")
    args = ap.parse_args()
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill`: the running torchrun is ended too (finally)
    CHECKOUT[0] = (args.checkout or REPO).resolve()
    VALIDATE_CHECKOUTS[:] = [Path(c).resolve() for c in args.validate_checkouts.split(",") if c]
    root = args.root or Path(tempfile.mkdtemp(prefix="data_startup_"))
    root.mkdir(parents=True, exist_ok=True)
    sizes = [(s, SIZES.get(s) or int(float(s[:-1]) * {"B": 1e9, "T": 1e12}[s[-1]])) for s in args.sizes.split(",")]
    layouts = args.layouts.split(",")
    common = [*TRAIN, f"model.seq_length={args.seq}"]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"{_gb(_mem_available())} GiB available; root {root}", flush=True)
    mock = {}
    if args.validate_only:
        layouts = []
    for layout in layouts:
        par = ["parallel.tensor=2"] if layout == "tp2" else []
        mock[layout] = run_ours("tiny_llama", [*common, *par, "data.mock=true", f"data.cache_dir={root}/cache_mock"],
                                root / f"mock_{layout}", root / f"mock_{layout}.log")
        shutil.rmtree(root / f"mock_{layout}", ignore_errors=True)
    rows, validations, skipped, peak_disk = [], [], [], 0
    interrupted = None
    try:
        mock_data = [*(x for x in common if not x.startswith("data.mock=")), "data.mock=true"]
        validations += validate_rows("tiny_llama", mock_data, root / "cache_validate",
                                     root / "validate_mock", {"size": "mock", "prefixes": 0, "metadata": "-",
                                                              "docs": 0})
        for size_name, tokens in sizes:
            for n_prefix, meta in ((int(x), m) for x in args.prefixes.split(",") for m in args.metadata.split(",")):
                corpus = root / f"corpus_{size_name}_{n_prefix}_{meta}"
                t0 = time.perf_counter()
                blend, docs = make_blend(corpus, tokens, n_prefix, meta=meta != "without")
                made = time.perf_counter() - t0
                config = str(write_config(root / f"config_{size_name}_{n_prefix}_{meta}.yaml", blend))
                idx_bytes = sum(p.stat().st_size for p in corpus.glob("*.idx"))
                print(f"corpus {size_name} tokens in {n_prefix} prefix(es) {meta} metadata: {docs:,} documents, "
                      f".idx {_gb(idx_bytes)} GiB, written in {made:.1f} s", flush=True)
                validations += validate_rows(config, common, root / "cache_validate",
                                             root / f"validate_{size_name}_{n_prefix}_{meta}",
                                             {"size": size_name, "prefixes": n_prefix, "metadata": meta, "docs": docs})
                for layout in layouts:
                    need = estimate_bytes(docs, tokens, n_prefix, args.seq, layout)
                    if need > min(_mem_available() - (3 << 30), args.max_gib * 2**30):
                        why = (f"Megatron's cold build needs ~{_gb(need)} GiB (--max-gib {args.max_gib:g}, "
                               f"{_gb(_mem_available())} GiB available)")
                        skipped.append(f"{size_name} in {n_prefix:,} prefix(es), {layout.upper()}: {why}")
                        print(f"  {layout}: skipped: {why}", flush=True)
                        continue
                    par = ["parallel.tensor=2"] if layout == "tp2" else []
                    for who in ("ours", "floor"):
                        cache = root / f"cache_{who}"
                        overrides = [*common, *par, f"data.cache_dir={cache}"]
                        for state in ("cold", "warm"):
                            load = os.getloadavg()[0]
                            tag = f"{size_name}_{n_prefix}_{meta}_{layout}_{who}_{state}"
                            if who == "ours":
                                res = run_ours(config, overrides, root / f"run_{tag}", root / f"{tag}.log")
                                shutil.rmtree(root / f"run_{tag}", ignore_errors=True)
                            else:
                                res = run_floor(config, overrides, 2 if layout == "tp2" else 1, root / f"{tag}.log")
                            disk = sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())
                            peak_disk = max(peak_disk, disk)
                            rows.append({"size": size_name, "tokens": tokens, "prefixes": n_prefix, "docs": docs,
                                         "metadata": meta,
                                         "layout": layout, "who": who, "state": state, "load": load,
                                         **{k: v for k, v in res.items() if k != "log"}})
                            print(f"  {tag}: " + (f"data {res['data_s']:.2f} s (check {res['check_s']:.2f} + build "
                                  f"{res['build_s']:.2f}), first loss {res['first_loss_s']:.1f} s" if who == "ours"
                                  else f"build {res['build_s']:.2f} s") + f", load {load:.1f}, disk {_gb(disk)} GiB",
                                  flush=True)
                        shutil.rmtree(cache, ignore_errors=True)
                if not args.keep:
                    shutil.rmtree(corpus, ignore_errors=True)
    except (KeyboardInterrupt, SystemExit) as exc:  # kill, Ctrl-C or a failed run: the rows so far still print
        interrupted = exc
    if rows:
        print_table(rows, mock, peak_disk)
    for line in skipped:
        print(f"skipped: {line}")
    print("\n| checkout | tokens | prefixes | metadata | documents | cache | `python -m pretrain validate` s | load "
          "| its peak RSS GiB | Megatron-Core checks | its check line |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in validations:
        print(f"| {v['checkout']} | {v['size']} | {v['prefixes']:,} | {v['metadata']} | {v['docs']:,} | {v['state']} "
              f"| {v['s']:.2f} "
              f"| {v['load']:.1f} | {_gb(v['rss'])} | {'from the cache' if v['megatron_cached'] else 'run'} "
              f"| {v['check'] or '(mock data)'} |")
    if args.json_out:
        mock_rows = {k: {kk: vv for kk, vv in v.items() if kk != "log"} for k, v in mock.items()}
        args.json_out.write_text(json.dumps({"rows": rows, "validate": validations, "mock": mock_rows,
                                             "skipped": skipped}, indent=1))
    print(f"benchmark wall time {(time.perf_counter() - started) / 60:.1f} min; checkout {CHECKOUT[0]}")
    if interrupted is not None:
        print("interrupted: the tables above hold only the rows measured before", flush=True)
        raise interrupted


def print_table(rows: list[dict], mock: dict, peak_disk: int) -> None:
    def peak(res: dict, key: str) -> int:
        return max((p.get(key, 0) for p in res["peaks"].values()), default=0)

    print("\n| tokens | prefixes | documents | layout | cache | ours: data s | Megatron-Core s | ratio | overhead s "
          "| first loss s (mock) | ours peak RSS GiB | ours RSS − mock GiB | Megatron RSS growth GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    by_key = {(r["size"], r["prefixes"], r["metadata"], r["layout"], r["who"], r["state"]): r for r in rows}
    for (size, n, meta, layout, who, state), ours in by_key.items():
        if who != "ours":
            continue
        floor = by_key.get((size, n, meta, layout, "floor", state))
        if floor is None:
            continue
        m = mock[layout]
        floor_growth = max(peak_r - before for peak_r, before in
                           zip((floor["peaks"].get(r, {}).get("VmHWM", 0) for r in sorted(floor["peaks"])),
                               floor["rss_before"]))
        ratio = ours["data_s"] / floor["build_s"] if floor["build_s"] > 0 else float("nan")
        what = f"{n:,}" + ("" if meta == "with" else " (no metadata)")
        print(f"| {size} | {what} | {ours['docs']:,} | {layout.upper()} | {state} | {ours['data_s']:.2f} | "
              f"{floor['build_s']:.2f} | {ratio:.2f} | {ours['data_s'] - floor['build_s']:+.2f} | "
              f"{ours['first_loss_s']:.1f} ({m['first_loss_s']:.1f}) | {_gb(peak(ours, 'VmHWM'))} | "
              f"{_gb(peak(ours, 'VmHWM') - peak(m, 'VmHWM'))} | {_gb(floor_growth)} |")
    print("\nmock runs (first loss s, peak RSS GiB): " + ", ".join(
        f"{k.upper()} {v['first_loss_s']:.1f} s / {_gb(peak(v, 'VmHWM'))}" for k, v in mock.items()))
    print(f"peak disk use under the root: {_gb(peak_disk)} GiB; load average at the end: "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_floor":
        floor_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:])
    else:
        main()
