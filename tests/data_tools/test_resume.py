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
