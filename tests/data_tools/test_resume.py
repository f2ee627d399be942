"""An interrupted run leaves no valid-looking dataset and --resume finishes it with identical bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

import data_tools.preprocess as pp

from .conftest import SP_ARGS, corpus_texts, write_jsonl


def test_interrupt_then_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", corpus_texts(40, 3000))
    pp.preprocess([str(corpus)], str(tmp_path / "full"), append_eod=True, batch_bytes=16 << 10, **SP_ARGS)

    real, calls = pp._write_state, {"n": 0}

    def interrupt_after_three(path, state):  # fault injection: Ctrl-C after the 3rd batch
        real(path, state)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(pp, "_write_state", interrupt_after_three)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess([str(corpus)], str(tmp_path / "part"), append_eod=True, batch_bytes=16 << 10, **SP_ARGS)
    assert not (tmp_path / "part_text_document.idx").exists()
    assert not (tmp_path / "part_text_document.bin").exists()
    monkeypatch.setattr(pp, "_write_state", real)
    s = pp.preprocess(
        [str(corpus)], str(tmp_path / "part"), append_eod=True, batch_bytes=16 << 10, resume=True, **SP_ARGS
    )
    assert s.resumed and s.documents == 40
    for ext in ("bin", "idx"):
        assert (tmp_path / f"part_text_document.{ext}").read_bytes() == (
            tmp_path / f"full_text_document.{ext}"
        ).read_bytes()
    assert not list(tmp_path.glob("part*tmp")) and not list(tmp_path.glob("*state*"))


def _preprocess_cli(corpus: Path, prefix: Path, *extra: str):
    from tests.cli import run_cli

    return run_cli("data_tools", ["preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                                  "--tokenizer-type", "sentencepiece", "--tokenizer-model",
                                  SP_ARGS["tokenizer_model"], "--no-progress", *extra])


def test_resume_of_other_options_is_refused_naming_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--resume` never re-tokenises over an output or a resume state made with other options: a finished output
    of these options is left alone ("nothing to resume"), one of others is refused naming both option sets, and so
    is the state of an interrupted run with other options (the state is kept for a resume with its options)."""
    corpus = write_jsonl(tmp_path / "c.jsonl", corpus_texts(40, 3000))
    prefix = tmp_path / "out"
    made = _preprocess_cli(corpus, prefix, "--append-eod")
    assert made.rc == 0, made
    files = [tmp_path / f"out_text_document.{ext}" for ext in ("bin", "idx", "meta.json")]
    before = [(f.read_bytes(), f.stat().st_mtime_ns) for f in files]

    other = _preprocess_cli(corpus, prefix, "--resume")  # without --append-eod this time
    assert other.rc == 1, other
    assert f"error: nothing to resume: {prefix}_text_document is complete, made with other inputs or options " \
           "(append_eod: the output's True, this run's False). It was made with tokenizer sentencepiece " \
           "tokenizer.model (sha256 " in other.stderr, other
    assert "append_eod True" in other.stderr and "this run asks for tokenizer sentencepiece" in other.stderr, other
    same = _preprocess_cli(corpus, prefix, "--resume", "--append-eod")
    assert same.rc == 0, same
    assert same.stdout.startswith(f"nothing to resume: the output {prefix}_text_document is complete, made with "
                                  "tokenizer sentencepiece tokenizer.model"), same
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == before  # nothing rewritten

    real, calls = pp._write_state, {"n": 0}

    def interrupt_after_two(path, state):
        real(path, state)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(pp, "_write_state", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess([str(corpus)], str(tmp_path / "part"), append_eod=True, batch_bytes=16 << 10, **SP_ARGS)
    monkeypatch.setattr(pp, "_write_state", real)
    state = tmp_path / f"part{pp.STATE_SUFFIX}"
    kept = state.read_bytes()
    refused = _preprocess_cli(corpus, tmp_path / "part", "--resume", "--keep-empty", "--append-eod")
    assert refused.rc == 1, refused
    assert f"error: --resume: {state} is of an interrupted run with other inputs or options (keep_empty: the " \
           "interrupted run's False, this run's True). It was made with tokenizer" in refused.stderr, refused
    assert state.read_bytes() == kept and not (tmp_path / "part_text_document.bin").exists()
