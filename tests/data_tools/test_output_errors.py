"""Output that cannot be written: a clear one-line error naming the path, exit status 1, and no
valid-looking (or any) partial dataset left behind.

We run as root, so ``chmod`` cannot make a directory unwritable; these tests use real kernel
refusals instead: a path under a regular file (ENOTDIR), procfs (files cannot be created there),
a read-only tmpfs (EROFS) and a 1 MiB tmpfs (ENOSPC). Mounting needs root with CAP_SYS_ADMIN;
where that is not available the tmpfs tests are skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from data_tools.__main__ import main
from data_tools.preprocess import PreprocessError, preprocess

from .conftest import SP_ARGS, corpus_texts, write_jsonl


def _cli(corpus: Path, prefix: Path, *extra: str) -> list[str]:
    return [
        "preprocess",
        "--input",
        str(corpus),
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "sentencepiece",
        "--tokenizer-model",
        SP_ARGS["tokenizer_model"],
        "--no-progress",
        *extra,
    ]


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_output_prefix_under_a_regular_file(tmp_path: Path, small_corpus: Path, capsys) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    with pytest.raises(PreprocessError, match=f"output directory is not a directory: {blocker}$"):
        preprocess([str(small_corpus)], str(blocker / "o"), **SP_ARGS)
    assert main(_cli(small_corpus, blocker / "o")) == 1
    assert _one_error_line(capsys.readouterr().err) == f"error: output directory is not a directory: {blocker}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "corpus.jsonl"]


def test_output_directory_refused_by_the_kernel(small_corpus: Path, capsys) -> None:
    # procfs: root cannot create files there, and access(2) says so.
    with pytest.raises(PreprocessError, match="output directory is not writable: /proc/self$"):
        preprocess([str(small_corpus)], "/proc/self/o", **SP_ARGS)
    assert main(_cli(small_corpus, Path("/proc/self/o"))) == 1
    assert _one_error_line(capsys.readouterr().err) == "error: output directory is not writable: /proc/self"


def test_output_file_cannot_be_created(tmp_path: Path, small_corpus: Path, capsys) -> None:
    # The directory is writable but the temporary's name is taken by a directory (EISDIR on open).
    (tmp_path / "o_text_document.bin.tmp").mkdir()
    msg = f"cannot create output file {tmp_path}/o_text_document.bin.tmp: Is a directory"
    with pytest.raises(PreprocessError, match=f"^{msg}$"):
        preprocess([str(small_corpus)], str(tmp_path / "o"), **SP_ARGS)
    assert main(_cli(small_corpus, tmp_path / "o")) == 1
    assert _one_error_line(capsys.readouterr().err) == f"error: {msg}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "o_text_document.bin.tmp"]


def test_read_only_output_directory(tmpfs, small_corpus: Path, capsys) -> None:
    ro = tmpfs("ro", "size=1m,ro")
    with pytest.raises(PreprocessError, match=f"output directory is not writable: {ro}$"):
        preprocess([str(small_corpus)], str(ro / "o"), **SP_ARGS)
    assert main(_cli(small_corpus, ro / "o")) == 1
    assert _one_error_line(capsys.readouterr().err) == f"error: output directory is not writable: {ro}"
    assert list(ro.iterdir()) == []


def test_disk_full_mid_run_leaves_nothing(tmpfs, tmp_path: Path, capsys) -> None:
    full = tmpfs("full", "size=1m")
    # ~3 MB of text -> ~1.5 MB of uint16 tokens: more than the 1 MiB file system holds.
    corpus = write_jsonl(tmp_path / "big.jsonl", corpus_texts(60, 6000) * 9)
    assert corpus.stat().st_size > 2_500_000
    with pytest.raises(PreprocessError, match=rf"{full}/o_text_document\S* failed: No space left on device"):
        preprocess([str(corpus)], str(full / "o"), append_eod=True, batch_bytes=64 << 10, **SP_ARGS)
    assert list(full.iterdir()) == []  # no .bin/.idx, no temporaries, no resume state
    assert main(_cli(corpus, full / "o", "--batch-mb", "0.0625")) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert str(full / "o_text_document") in line and line.endswith("No space left on device")
    assert list(full.iterdir()) == []


def test_failure_while_writing_the_last_index_leaves_no_dataset(tmp_path: Path, monkeypatch) -> None:
    # Fault injection: the disk fills up while the second key's .idx is written. The first key's
    # dataset must not have been renamed into place either.
    import errno

    import pretrain.dataset_format.indexed as indexed

    real, calls = indexed.write_index_streaming, []

    def fill_up_on_second(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(indexed, "write_index_streaming", fill_up_on_second)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "doc {i}", "title": "title {i}"}}\n' for i in range(5)))
    out = tmp_path / "out"
    out.mkdir()
    msg = f"finalizing {out}/o_title_document.idx.tmp failed: No space left on device"
    with pytest.raises(PreprocessError, match=f"^{msg}$"):
        preprocess([str(corpus)], str(out / "o"), json_keys=["text", "title"], **SP_ARGS)
    assert list(out.iterdir()) == []
