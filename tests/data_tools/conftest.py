"""Shared fixtures: a small slice of the embedded corpus, the embedded tokenizers, and tmpfs mounts (full disks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from data_tools.assets import DEFAULT_CORPUS
from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

SP_ARGS = {"tokenizer_type": "sentencepiece", "tokenizer_model": str(MISTRAL_TOKENIZER)}
GPT2_ARGS = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(GPT2_VOCAB), "merge_file": str(GPT2_MERGES)}


def corpus_texts(n: int = 24, max_chars: int = 6000) -> list[str]:
    """The first ``n`` documents of the embedded corpus, cut to ``max_chars`` (keeps tests fast)."""
    out = []
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line)["text"][:max_chars])
            if len(out) == n:
                break
    return out


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", corpus_texts())


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``tmpfs(name, options)`` mounts a fresh tmpfs at ``tmp_path/name`` (unmounted afterwards)."""
    mounted: list[Path] = []

    def make(name: str, options: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        d = tmp_path / name
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs in this sandbox: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
