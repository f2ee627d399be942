"""The index facts in PREFIX.meta.json (sizes + fingerprint): with them the trainer's check reads the .idx header
and its two ends, not the whole index; without them, or when they do not match, it reads everything, as
`verify` always does (`verify --update-meta` records them). And Megatron's index cache: a truncated entry left
by a killed start is removed and rebuilt, the samples unchanged."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_tools.__main__ import main
from pretrain.dataset_format.check import check_dataset
from pretrain.dataset_format.fingerprint import EDGE_BYTES
from pretrain.dataset_format.indexed import IndexedFormatError, IndexedWriter, idx_path, read_index
from pretrain.dataset_format.metadata import commit_meta, dataset_record, write_meta_tmp
from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER
from pretrain.tokenizer.identity import describe_tokenizer

DOCS = 12_000  # .idx of 240 KB: more than its two hashed ends


def _dataset(prefix: Path) -> Path:
    """A dataset written as preprocess writes one (temporaries, metadata, commit) with DOCS documents."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, DOCS).astype(np.int32)
    w = IndexedWriter(prefix, np.uint16)
    w.add_batch(rng.integers(0, 32000, int(lengths.sum())).astype(np.uint16), lengths, np.ones(DOCS, np.int64))
    w.prepare()
    write_meta_tmp(prefix, dataset_record(
        tool="test", tokenizer=describe_tokenizer("sentencepiece", str(MISTRAL_TOKENIZER)), append_eod=False,
        dtype="uint16", documents=DOCS, sequences=DOCS, tokens=int(lengths.sum()), max_token_id=31999, inputs=[]))
    w.commit()
    commit_meta(prefix)
    return prefix


def _meta(prefix: Path) -> dict:
    return json.loads(Path(f"{prefix}.meta.json").read_text())


def _poke(prefix: Path, offset: int, value: int) -> None:
    with open(idx_path(prefix), "r+b") as f:
        f.seek(offset)
        f.write(np.int64(value).tobytes())


def test_metadata_check_reads_header_and_ends_full_check_everything(tmp_path):
    ds = _dataset(tmp_path / "d")
    facts = _meta(ds)["index"]
    assert facts["idx_bytes"] == idx_path(ds).stat().st_size > 2 * EDGE_BYTES
    got = check_dataset(ds, trust_metadata=True)
    assert (got.checked, got.max_token_id, got.max_id_from) == ("metadata", 31999, "metadata")
    assert check_dataset(ds).checked == "full"

    # A pointer in the middle of the index: the metadata check does not read it; the full check (verify) does.
    middle = 34 + 4 * DOCS + 8 * (DOCS // 2)
    assert EDGE_BYTES < middle < facts["idx_bytes"] - EDGE_BYTES
    bad = tmp_path / "bad"
    for ext in ("bin", "idx", "meta.json"):
        shutil.copy(f"{ds}.{ext}", f"{bad}.{ext}")  # another path: the fingerprint holds
    _poke(bad, middle, 1)
    assert check_dataset(bad, trust_metadata=True).checked == "metadata"
    with pytest.raises(IndexedFormatError, match=f"sequence pointer {DOCS // 2} is 1"):
        check_dataset(bad)

    # The last document index changed: the fingerprint no longer matches, so everything is read (and refused).
    shutil.copy(f"{ds}.idx", f"{bad}.idx")
    _poke(bad, facts["idx_bytes"] - 8, DOCS - 1)
    with pytest.raises(IndexedFormatError, match="document indices are not non-decreasing"):
        check_dataset(bad, trust_metadata=True)

    # A truncated .bin is refused with the full check's words.
    shutil.copy(f"{ds}.idx", f"{bad}.idx")
    os.truncate(f"{bad}.bin", 100)
    with pytest.raises(IndexedFormatError, match=r"bad\.bin: 100 bytes but the index describes .* \(truncated\)"):
        check_dataset(bad, trust_metadata=True)


def test_old_metadata_is_read_in_full_with_one_note_until_update_meta(tmp_path, capsys):
    from pretrain.config import load_config
    from pretrain.validate import validate

    old, new = _dataset(tmp_path / "old"), _dataset(tmp_path / "new")
    meta = _meta(old)
    del meta["index"]
    Path(f"{old}.meta.json").write_text(json.dumps(meta))
    got = check_dataset(old, trust_metadata=True)
    assert (got.checked, got.why_full, got.max_token_id) == ("full", "no index facts", 31999)

    cfg = load_config("tiny_llama", [f"data.blend=[{old},{new}]"])
    header = "(1 from their metadata and .idx header, 0 from the verdict cache, 1 from their .idx header and sizes, " \
             "0 read in full)"
    assert header in "\n".join(validate(cfg, 1).notes)  # validate: a few reads of each file (the header check)
    notes = _trainer_check(cfg).notes  # the trainer's one-rank check: the old metadata's pair read in full
    assert [n for n in notes if "whole .idx" in n] == [
        f"1 dataset(s) were checked by reading their whole .idx because their .meta.json has no index facts "
        f"(written by an older data_tools) or facts that do not match: {old} (no index facts); `python -m "
        "data_tools verify PREFIX --update-meta` records them, so later starts read only the header"]
    assert "dataset files checked: 2 prefix(es) in " in "\n".join(notes)
    assert "(1 from their metadata and .idx header, 0 from the verdict cache, 1 read in full)" in "\n".join(notes)

    assert main(["verify", str(old), "--update-meta"]) == 0
    assert "index facts recorded in old.meta.json" in capsys.readouterr().out
    assert _meta(old)["index"] == _meta(new)["index"]  # the same contents (same seed): the same facts
    assert check_dataset(old, trust_metadata=True).checked == "metadata"
    assert not any("whole .idx" in n for n in _trainer_check(cfg).notes)


def _trainer_check(cfg, store: bool = False):
    """The trainer's one-rank data check (`pretrain.data.datasets.check_data_files_once` without a process group):
    the full read where the metadata cannot stand for the index; `store`: its verdicts kept, as train keeps them."""
    from pretrain.data.check import check_data_files
    from pretrain.data.plan import data_plan
    from pretrain.problems import Report
    from pretrain.tokenizer.choice import decide
    from pretrain.validate import store_verdicts

    r, data = Report(1), data_plan(cfg)
    check_data_files(data, decide(cfg.data, cfg.model.vocab_size, data.mock, cfg.model.preset), cfg.model, r)
    if store:
        store_verdicts(r, data.cache_dir)
    return r


def test_truncated_cache_entry_is_rebuilt_with_the_same_samples(small_datasets, tmp_path):
    from pretrain.config import load_config
    from pretrain.data.datasets import build_datasets
    from pretrain.data.plan import data_plan
    from pretrain.tokenizer.load import run_tokenizer

    cfg = load_config("tiny_llama", [f"data.blend=[{small_datasets['a']}]", f"run.dir={tmp_path / 'run'}"])
    tokenizer, said, data = run_tokenizer(cfg.data), [], data_plan(cfg)
    first, _ = build_datasets(data, tokenizer, 8, log=said.append)
    want = [first[i]["tokens"].tolist() for i in range(8)]
    assert "indices built in" in said[-1] and f"cached in {tmp_path / 'run' / 'data_cache'}" in said[-1], said
    (shuffle,) = (tmp_path / "run" / "data_cache").glob("*-GPTDataset-train-shuffle_index.npy")
    size = shuffle.stat().st_size
    again, _ = build_datasets(data, tokenizer, 8, log=said.append)
    assert "read from the cache" in said[-1] and "nothing rebuilt" in said[-1], said
    os.truncate(shuffle, size - 8)  # a start killed while numpy.save wrote the last array
    rebuilt, _ = build_datasets(data, tokenizer, 8, log=said.append)
    assert said[-2].startswith("[pretrain] data: removed the index cache entry ") and "built in" in said[-1]
    assert f"(truncated, left by an interrupted start: shuffle_index.npy has {size - 8:,} of {size:,} bytes)" \
        in said[-2], said
    assert shuffle.stat().st_size == size
    (samples,) = (tmp_path / "run" / "data_cache").glob("*-GPTDataset-train-sample_index.npy")
    np.save(samples, np.full_like(np.load(samples), 10**9))  # complete, but garbage: rebuilt with one line
    fixed, _ = build_datasets(data, tokenizer, 8, log=said.append)
    assert "(corrupt: sample_index points outside the " in said[-2] and "built in" in said[-1], said
    assert [fixed[i]["tokens"].tolist() for i in range(8)] == want

    # Values that look valid (zeros: every sample would be sample 0): caught by the digest recorded at the build.
    np.save(shuffle, np.zeros_like(np.load(shuffle)))
    assert shuffle.stat().st_size == size
    zeros, _ = build_datasets(data, tokenizer, 8, log=said.append)
    assert said[-2].startswith("[pretrain] data: removed the index cache entry ") and "built in" in said[-1], said
    assert "(shuffle_index.npy does not match the digest recorded when it was written: CRC-32 " in said[-2], said
    assert [zeros[i]["tokens"].tolist() for i in range(8)] == want
    # Random bytes are unreadable, not "truncated" (nothing about their size says so).
    shuffle.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    build_datasets(data, tokenizer, 8, log=said.append)
    assert "(unreadable: shuffle_index.npy is not a .npy file" in said[-2] and "built in" in said[-1], said
    back, _ = build_datasets(data, tokenizer, 8, log=said.append)
    assert "read from the cache" in said[-1] and "checked against the digests recorded then" in said[-1], said
    assert [back[i]["tokens"].tolist() for i in range(8)] == want
    assert [rebuilt[i]["tokens"].tolist() for i in range(8)] == want == [again[i]["tokens"].tolist() for i in range(8)]
    assert read_index(small_datasets["a"]).num_documents == 40


def test_a_dataset_without_metadata_is_read_in_full_once_then_from_the_verdict_cache(small_datasets, tmp_path):
    """Megatron-LM's datasets have no .meta.json: the trainer's first check reads the whole .idx (and scans the .bin)
    and leaves its verdict beside Megatron's index caches; later starts check the header and sizes against it and
    read nothing in full. A touched file or a corrupt entry is checked in full again, never trusted."""
    from pretrain.config import load_config
    from pretrain.dataset_format.verdicts import entry_path

    ds, cache = tmp_path / "megatron_text_document", tmp_path / "run" / "data_cache"
    for ext in ("bin", "idx"):
        shutil.copy(f"{small_datasets['a']}.{ext}", f"{ds}.{ext}")
    cfg = load_config("tiny_llama", [f"data.blend=[{ds}]", f"run.dir={tmp_path / 'run'}"])

    def checked() -> str:
        r = _trainer_check(cfg, store=True)
        assert r.ok, r.text()
        (line,) = [ln for ln in r.notes if "dataset files checked" in ln]
        return line.split(" s (")[1]

    full = "0 from their metadata and .idx header, 0 from the verdict cache, 1 read in full)"
    cached = "0 from their metadata and .idx header, 1 from the verdict cache, 0 read in full)"
    assert checked() == full
    assert checked() == cached
    st = os.stat(f"{ds}.bin")
    os.utime(f"{ds}.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: re-read, then cached again
    assert (checked(), checked()) == (full, cached)
    entry_path(cache, str(ds)).write_text('{"format": "megapretrain-dataset-check", "tokens": ')  # corrupt
    assert (checked(), checked()) == (full, cached)


def test_validate_checks_a_dataset_without_metadata_in_a_few_reads(small_datasets, tmp_path, monkeypatch):
    """`validate` (the CLI users run before launching) never reads a whole .idx: without metadata that stands for
    the index and without a verdict of an earlier full read, it checks the header, the first and last pointers and
    document indices and the sizes. What only the full read sees (a pointer inside the index) passes `validate`
    and is refused by `train`'s one-rank check before any batch is read."""
    import pretrain.dataset_format.check as dataset_check
    from tests.cli import run_cli
    from tests.pretrain.ckpt_helpers import command, log_text, run

    ds = tmp_path / "megatron_text_document"
    for ext in ("bin", "idx"):
        shutil.copy(f"{small_datasets['a']}.{ext}", f"{ds}.{ext}")
    base = ["validate", "tiny_llama", f"data.blend=[{ds}]", f"run.dir={tmp_path / 'run'}"]

    def no_full_read(*args, **kwargs):
        raise AssertionError("validate read a whole .idx")

    monkeypatch.setattr(dataset_check, "check_consistency", no_full_read)
    ok = run_cli("pretrain", base)
    assert ok.rc == 0, ok
    assert "(0 from their metadata and .idx header, 0 from the verdict cache, 1 from their .idx header and sizes, " \
           "0 read in full)" in ok.stdout, ok
    info = read_index(ds)
    n, tokens = info.num_sequences, info.num_tokens
    header = 34  # magic 9 + version 8 + dtype 1 + two counts 8 + 8

    # What the few reads catch: a .bin one token short, a last pointer that does not end at the .bin's size.
    with open(f"{ds}.bin", "r+b") as f:
        f.truncate((tokens - 1) * 2)
    short = run_cli("pretrain", base)
    assert short.rc == 2 and f"{ds}.bin: {(tokens - 1) * 2} bytes but the index describes {tokens} tokens of " \
        f"uint16 = {tokens * 2} bytes (truncated)" in short.stderr, short
    shutil.copy(f"{small_datasets['a']}.bin", f"{ds}.bin")
    last = int(info.sequence_pointers[-1])
    _poke(ds, header + 4 * n + 8 * (n - 1), last + 2)
    moved = run_cli("pretrain", base)
    assert moved.rc == 2 and f"{ds}.bin: {tokens * 2} bytes but the index describes {tokens + 1} tokens" \
        in moved.stderr, moved
    _poke(ds, header + 4 * n + 8 * (n - 1), last)

    # A pointer inside the index: validate does not read it; train's one-rank check does, before training.
    _poke(ds, header + 4 * n + 8 * (n // 2), int(info.sequence_pointers[n // 2]) + 2)
    monkeypatch.undo()
    inside = run_cli("pretrain", base)
    assert inside.rc == 0, inside
    log = tmp_path / "train.log"
    rc = run(command([f"data.blend=[{ds}]", f"run.dir={tmp_path / 'run'}", "train.steps=1"]), log, timeout=600)
    assert rc != 0 and f"{ds}.idx: sequence pointer {n // 2} is " in log_text(log), log_text(log)[-3000:]
