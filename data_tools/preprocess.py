"""``preprocess``: corpus -> ``PREFIX_{key}_document.{bin,idx}`` in Megatron-Core's indexed format.

Output is byte-identical to Megatron-LM's ``tools/preprocess_data.py`` (one sequence per
document, EOD appended with ``--append-eod``, uint16 below 65,500 ids) for clean input. Memory is
bounded: batches stream from the reader to the encoder to temporaries next to the output, and the
index arrays are spilled to disk. A state file records the last complete batch so ``--resume``
continues an interrupted run; final files appear (``.bin`` then ``.idx``) only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from data_tools import made_with
from data_tools.inputs import Batch, InputError, expand_inputs
from data_tools.stages import Stages
from data_tools.tokenizers import BatchEncoder, build_batch_encoder
from pretrain.dataset_format.indexed import IndexedWriter, optimal_dtype
from pretrain.dataset_format.metadata import commit_meta, dataset_record, meta_path, write_meta_tmp
from pretrain.files import write_atomic
from pretrain.tokenizer.identity import tokenizer_identity
from pretrain.tokenizer.spec import TokenizerSpec, resolve_spec

STATE_SUFFIX = ".preprocess-state.json"
_MAX_REPORTED = 10  # skipped lines printed per reason


class PreprocessError(RuntimeError):
    """A run that cannot complete; the message names the cause."""


@dataclass
class Summary:
    """What a run did."""

    outputs: dict[str, str]
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_skipped: dict[str, str] = field(default_factory=dict)  # reason -> FILE:LINE of its first occurrence
    seconds: float = 0.0  # from the call to the end (start-up + processing)
    startup_seconds: float = 0.0  # argument checks, tokenizer load and probe, output files created
    processing_seconds: float = 0.0  # tokenizer ready -> outputs in place (reading starts earlier)
    processing_cpu_seconds: float = 0.0  # CPU time of all threads during processing
    encoder: str = ""
    encoder_resets: int = 0  # times the encoder's caches were dropped to bound memory
    dtype: str = ""
    resumed: bool = False

    def format(self) -> str:
        mb = self.input_bytes / 1e6
        rate = mb / self.processing_seconds if self.processing_seconds else 0.0
        lines = [
            f"documents: {self.documents:,}",
            f"tokens:    {self.tokens:,} ({self.dtype})",
            f"input:     {mb:,.1f} MB in {self.seconds:.2f} s = start-up {self.startup_seconds:.2f} s + "
            f"processing {self.processing_seconds:.2f} s ({rate:.1f} MB/s, {self.processing_cpu_seconds:.2f} CPU-s, "
            f"encoder {self.encoder})",
        ]
        if self.skipped:
            lines.append("skipped:   " + ", ".join(
                f"{n:,} {why}" + (f" (first: {self.first_skipped[why]})" if why in self.first_skipped else "")
                for why, n in sorted(self.skipped.items())))
        else:
            lines.append("skipped:   none")
        if self.encoder_resets:
            lines.append(f"memory:    encoder caches dropped {self.encoder_resets} times to bound RSS")
        lines += [f"output:    {p}.bin/.idx (+ .meta.json: tokenizer, options, counts)" for p in self.outputs.values()]
        lines += [f"wrote:     {p}.bin {p}.idx {p}.meta.json (train with data.blend=[{p}])"
                  for p in self.outputs.values()]
        return "\n".join(lines)


def _reason_class(reason: str) -> str:
    return reason.split(" (")[0]


class _Progress:
    def __init__(self, total_bytes: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total_bytes, stream, enabled
        self.t0 = time.monotonic()
        self.last = 0.0

    def update(self, done_bytes: int, docs: int, text_bytes: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.5):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        frac = min(1.0, done_bytes / self.total) if self.total else 1.0
        eta = (dt / frac - dt) if frac > 0 else float("inf")
        bar = "#" * int(frac * 24)
        self.stream.write(
            f"\r[{bar:<24}] {frac * 100:5.1f}% {docs / dt:,.0f} docs/s {text_bytes / dt / 1e6:,.1f} MB/s "
            f"{tokens / dt / 1e6:,.2f} Mtok/s ETA {eta:,.0f}s "
        )
        if final:
            self.stream.write("\n")
        self.stream.flush()


def _fingerprint(files: list[Path], spec: TokenizerSpec, keys: list[str], append_eod: bool, keep_empty: bool) -> str:
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps([asdict(spec), keys, append_eod, keep_empty]).encode())
    return h.hexdigest()


def assemble(
    tokens: np.ndarray,
    offsets: np.ndarray,
    seqs_per_doc: list[int] | None,
    eod: int | None,
    keep_empty: bool,
    dtype: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Megatron-LM's per-document layout for a batch of encoded sequences.

    Empty sequences are dropped, EOD (if given) is appended to the last sequence of each non-empty
    document. Returns ``(tokens, sequence_lengths, sequences_per_doc, empty_doc_mask)``; empty
    documents are kept as zero-sequence documents only when ``keep_empty`` (Megatron-LM does that).
    ``dtype``: the output token dtype (ids must already be known to fit it).
    """
    tokens = np.asarray(tokens) if dtype is None else np.asarray(tokens).astype(dtype, copy=False)
    n_seq = offsets.size - 1
    seq_len = np.diff(offsets)
    n_doc = n_seq if seqs_per_doc is None else len(seqs_per_doc)
    doc_of_seq = np.arange(n_seq) if seqs_per_doc is None else np.repeat(np.arange(n_doc), seqs_per_doc)
    kept = np.flatnonzero(seq_len > 0)
    kept_doc = doc_of_seq[kept]
    per_doc = np.bincount(kept_doc, minlength=n_doc)
    empty = per_doc == 0
    lengths = seq_len[kept].astype(np.int64)
    if eod is not None and kept.size:
        last = np.ones(kept.size, dtype=bool)
        last[:-1] = kept_doc[1:] != kept_doc[:-1]
        tokens = np.insert(tokens, offsets[kept[last] + 1], eod)
        lengths[last] += 1
    if not keep_empty:
        per_doc = per_doc[~empty]
    return tokens, lengths, per_doc, empty


def _check_output_dir(output_prefix: str) -> None:
    out_dir = Path(output_prefix).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise PreprocessError(f"output directory is not a directory: {out_dir}")
    if not out_dir.is_dir():
        raise PreprocessError(f"output directory does not exist: {out_dir}")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PreprocessError(f"output directory is not writable: {out_dir}")


def _check_numbers(workers: Any, batch_bytes: Any) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PreprocessError(f"--workers {workers}: must be a whole number of tokenizer threads, at least 1")
    if not isinstance(batch_bytes, int) or batch_bytes < 1:
        raise PreprocessError(f"--batch-mb: must be positive (got {batch_bytes / (1 << 20):g} MB)")


def _check_prefix(output_prefix: str) -> None:
    """An output prefix is not a file name: ``o.bin`` would write ``o.bin_text_document.bin``."""
    for ext in (".bin", ".idx", ".meta.json"):
        if output_prefix.endswith(ext):
            raise PreprocessError(f"--output-prefix {output_prefix}: a prefix has no extension (preprocess writes "
                                  f"PREFIX_{{key}}_document.bin/.idx); use {output_prefix[: -len(ext)]}")


@dataclass
class _Run:
    """One run's options and running totals, shared by the steps of :func:`preprocess`."""

    files: list[Path]
    keys: list[str]
    prefixes: dict[str, str]
    output_prefix: str
    spec: TokenizerSpec
    append_eod: bool
    strict: bool
    keep_empty: bool
    log: TextIO
    state_path: Path
    fingerprint: str
    options: dict[str, Any]  # what the output is made with (data_tools.made_with), kept in the resume state
    writers: dict[str, IndexedWriter] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    reported: Counter[str] = field(default_factory=Counter)
    first_skipped: dict[str, str] = field(default_factory=dict)

    def open(self, enc: BatchEncoder, state: dict[str, Any] | None, start: tuple) -> tuple[Summary, Any, dict]:
        """Check the encoder, pick the dtype, restore a resumed run's totals and create the outputs."""
        if self.append_eod and enc.eod is None:
            raise PreprocessError(
                f"--append-eod: the tokenizer {self.spec.model or self.spec.vocab_file} defines no EOS token")
        dtype = optimal_dtype(enc.vocab_size)
        max_ids: dict[str, int | None] = dict.fromkeys(self.keys, -1)  # None: unknown (resumed from an older state)
        summary = Summary(outputs=self.prefixes, encoder=enc.name, dtype=np.dtype(dtype).name)
        if state is not None:
            summary.documents, summary.tokens, summary.input_bytes = state["documents"], state["tokens"], state["bytes"]
            self.skipped.update(state["skipped"])
            self.first_skipped.update(state.get("first_skipped") or {})
            max_ids.update(state.get("max_ids") or dict.fromkeys(self.keys))
            summary.resumed = True
            print(f"resuming from {self.files[start[0]]} line {start[1]:,}", file=self.log)
        for k, p in self.prefixes.items():
            try:
                self.writers[k] = IndexedWriter(p, dtype, resume_sizes=state["sizes"][k] if state else None)
            except OSError as e:
                raise PreprocessError(f"cannot create output file {e.filename or p}: {e.strerror}") from e
        return summary, dtype, max_ids

    def report_skipped(self, batch: Batch) -> None:
        for line, reason in batch.skipped:
            cls = _reason_class(reason)
            self.skipped[cls] += 1
            self.first_skipped.setdefault(cls, f"{self.files[batch.file_index]}:{line}")
            self.reported[cls] += 1
            if self.reported[cls] <= _MAX_REPORTED:
                print(f"\rskipped {self.files[batch.file_index]}:{line}: {reason}", file=self.log)

    def report_empty(self, batch: Batch, k: str, empty: np.ndarray) -> None:
        for j in np.flatnonzero(empty):
            where = f"{self.files[batch.file_index]}:{batch.lines[j]}"
            if self.strict and not self.keep_empty:
                raise InputError(f"{where}: empty document ({k!r})")
            self.reported["empty document"] += 1
            if not self.keep_empty:
                self.first_skipped.setdefault("empty document", where)
            if self.reported["empty document"] <= _MAX_REPORTED and not self.keep_empty:
                what = f" ({k!r})" if len(self.keys) > 1 else ""
                print(f"\rskipped {where}: empty document{what}", file=self.log)
        if not self.keep_empty:
            self.skipped["empty document"] += int(empty.sum())

    def write_batch(self, batch: Batch, encoded: dict, enc: BatchEncoder, dtype: Any, summary: Summary,
                    max_ids: dict[str, int | None]) -> None:
        """Assemble and append one encoded batch to every key's output, then record the resume state."""
        self.report_skipped(batch)
        n_docs_batch = 0
        for k in self.keys:
            tokens, offsets = encoded[k]
            if tokens.size and int(tokens.max()) >= enc.vocab_size:
                raise PreprocessError(f"token id {int(tokens.max())} >= vocab size {enc.vocab_size}")
            out_t, lengths, per_doc, empty = assemble(
                tokens, offsets, batch.seqs_per_doc[k], enc.eod if self.append_eod else None, self.keep_empty, dtype
            )
            if empty.any():
                self.report_empty(batch, k, empty)
            if out_t.size and max_ids[k] is not None:
                max_ids[k] = max(max_ids[k], int(out_t.max()))
            try:
                self.writers[k].add_batch(out_t, lengths, per_doc)
            except OSError as e:
                raise PreprocessError(f"writing {self.writers[k].tmp_bin} failed: {e.strerror}") from e
            summary.tokens += int(out_t.size)
            n_docs_batch = max(n_docs_batch, int(per_doc.size))
        summary.documents += n_docs_batch
        summary.input_bytes += batch.text_bytes
        try:
            sizes = {k: w.flush() for k, w in self.writers.items()}
            _write_state(self.state_path, {
                "fingerprint": self.fingerprint, "options": self.options,
                "position": [batch.file_index, batch.records_done, batch.byte_offset],
                "sizes": sizes, "documents": summary.documents, "tokens": summary.tokens,
                "bytes": summary.input_bytes, "skipped": dict(self.skipped), "max_ids": max_ids,
                "first_skipped": self.first_skipped,
            })  # fmt: skip
        except OSError as e:
            where = e.filename or self.output_prefix + "_*"
            raise PreprocessError(f"writing output {where} failed: {e.strerror}") from e

    def finish(self, enc: BatchEncoder, dtype: Any, summary: Summary, max_ids: dict[str, int | None]) -> None:
        """Write every key's index and ``PREFIX.meta.json``, then rename them all into place."""
        if summary.documents == 0:
            raise InputError(
                "no documents in the input"
                + (f" ({', '.join(f'{n} {w}' for w, n in self.skipped.items())} skipped)" if self.skipped else "")
                + ": "
                + ", ".join(map(str, self.files))
            )
        # Every key's index is written before any dataset is renamed into place: a failure (disk
        # full) leaves no key's dataset behind.
        identity = tokenizer_identity(self.spec, enc.vocab_size, enc.eod)
        sources = [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in self.files]
        for k, w in self.writers.items():
            try:
                w.prepare()
                write_meta_tmp(self.prefixes[k], dataset_record(
                    tool="data_tools preprocess", tokenizer=identity, append_eod=self.append_eod,
                    dtype=np.dtype(dtype).name, documents=w.num_documents, sequences=w.num_sequences,
                    tokens=w.num_tokens, max_token_id=max_ids[k] if max_ids[k] != -1 else None, inputs=sources,
                    json_key=k, keep_empty=self.keep_empty, strict=self.strict))
            except OSError as e:
                raise PreprocessError(f"finalizing {e.filename or self.prefixes[k]} failed: {e.strerror}") from e
        for k, w in self.writers.items():
            try:
                meta_path(self.prefixes[k]).unlink(missing_ok=True)  # never an old description beside new data
                w.commit()
                commit_meta(self.prefixes[k])
            except OSError as e:
                raise PreprocessError(f"renaming {self.prefixes[k]} into place failed: {e.strerror}") from e
        self.state_path.unlink(missing_ok=True)

    def discard(self, interrupted: bool) -> None:
        """After a failure: close the outputs; keep temporaries + state only when a resume is possible
        (interrupted, not rejected input)."""
        for w in self.writers.values():
            w.close()
        if not interrupted:
            for k, w in self.writers.items():
                w.discard()
                Path(f"{meta_path(self.prefixes[k])}.tmp").unlink(missing_ok=True)
            self.state_path.unlink(missing_ok=True)
            self.state_path.with_name(self.state_path.name + ".tmp").unlink(missing_ok=True)


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    json_keys: list[str] | None = None,
    append_eod: bool = False,
    workers: int = 1,
    strict: bool = False,
    keep_empty: bool = False,
    resume: bool = False,
    encoder: str = "auto",
    batch_bytes: int = 8 << 20,
    progress: bool | None = None,
    log: TextIO | None = None,
    memory_budget_bytes: int = 320 << 20,
) -> Summary:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.{bin,idx}``; return a :class:`Summary`.

    Three stages overlap: a reader thread parses batches (it starts while the tokenizer loads),
    an encoder thread tokenizes them, and this thread assembles and writes them. Queues between
    the stages hold at most two batches each, so memory does not grow with the input.

    ``memory_budget_bytes``: when the RSS has grown by more than this since processing began, the
    gigatoken encoder is rebuilt (its caches dropped; the ids do not change).

    Bad lines are skipped and counted (``strict=True``: the first raises :class:`InputError`).
    Raises :class:`InputError`, ``TokenizerError`` or :class:`PreprocessError` with a clear cause.
    """
    t0 = time.monotonic()
    log = log or sys.stderr
    keys = list(json_keys or ["text"])
    if len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys lists a key twice: {' '.join(keys)}")
    _check_numbers(workers, batch_bytes)
    _check_prefix(output_prefix)
    os.environ.setdefault("RAYON_NUM_THREADS", str(workers))
    spec = resolve_spec(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    files = expand_inputs(inputs)
    if not files:
        raise InputError("no input files given")
    _check_output_dir(output_prefix)

    state_path = Path(f"{output_prefix}{STATE_SUFFIX}")
    fingerprint = _fingerprint(files, spec, keys, append_eod, keep_empty)
    options = made_with.options(spec, keys, append_eod, keep_empty, strict, files)
    run = _Run(files, keys, {k: f"{output_prefix}_{k}_document" for k in keys}, output_prefix, spec, append_eod,
               strict, keep_empty, log, state_path, fingerprint, options)
    # --resume: an interrupted run of these inputs and options, else nothing (refused when the state or a finished
    # output is of others; NothingToResume for a finished output of these: data_tools.made_with)
    state = made_with.resume_state(options, state_path, fingerprint, list(run.prefixes.values()), log) \
        if resume else None
    start = tuple(state["position"]) if state is not None else (0, 0, 0)

    def on_bad(path: Path, line: int, reason: str) -> None:
        if strict:
            raise InputError(f"{path}:{line}: {reason}")

    stages = Stages()
    stages.start_reader(files, keys, batch_bytes, start, on_bad)  # reading overlaps the tokenizer's start-up
    ok = False
    try:
        enc: BatchEncoder = build_batch_encoder(spec, workers, encoder, log=lambda m: print(m, file=log))
        summary, dtype, max_ids = run.open(enc, state, start)
        total_disk = sum(p.stat().st_size for p in files)
        done_disk = sum(p.stat().st_size for p in files[: start[0]])
        show = progress if progress is not None else log.isatty()
        t_ready, cpu_ready = time.monotonic(), time.process_time()
        summary.startup_seconds = t_ready - t0
        bar = _Progress(total_disk, log, show)

        def count_reset() -> None:
            summary.encoder_resets += 1

        stages.start_encoder(enc, keys, memory_budget_bytes, count_reset)

        current_file, base_disk = start[0], done_disk
        while True:
            item = stages.get(stages.enc_q)
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            batch: Batch = item[0]
            if batch.file_index != current_file:
                base_disk += sum(p.stat().st_size for p in files[current_file : batch.file_index])
                current_file = batch.file_index
            run.write_batch(batch, item[1], enc, dtype, summary, max_ids)
            bar.update(base_disk + batch.progress_bytes, summary.documents, summary.input_bytes, summary.tokens)
        bar.update(total_disk, summary.documents, summary.input_bytes, summary.tokens, final=True)
        run.finish(enc, dtype, summary, max_ids)
        ok = True
    finally:
        stages.close()
        if not ok:
            run.discard(interrupted=isinstance(sys.exc_info()[1], KeyboardInterrupt))
    summary.skipped = dict(run.skipped)
    summary.first_skipped = dict(run.first_skipped)
    t_end = time.monotonic()
    summary.seconds = t_end - t0
    summary.processing_seconds = t_end - t_ready
    summary.processing_cpu_seconds = time.process_time() - cpu_ready
    return summary


def _write_state(path: Path, state: dict[str, Any]) -> None:
    # Not fsynced: it describes temporaries that are flushed, not synced, until the output is committed.
    write_atomic(path, json.dumps(state), durable=False)
