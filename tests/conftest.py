"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_tmp_dirs.py runs an inner session

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron-core's plain version in tests and their workers


def pytest_configure(config):
    from tests import launch_ledger

    launch_ledger.configure(config)


def pytest_collection_modifyitems(config, items):
    """`make test` leaves the `full` tests out (deselected, not skipped); `make test-all` keeps them. Tests marked
    `second_release` run only where `-m` selects them for their `mcore` mark (`make test-mcore`)."""
    from tests.tiers import everything, second_release_pass

    markexpr = config.getoption("markexpr") or ""

    def left_out(item) -> bool:
        if item.get_closest_marker("full") is not None and not everything():
            return True
        marks = {m.name for m in item.iter_markers()}
        return "second_release" in marks and not second_release_pass(markexpr, marks)

    dropped = [item for item in items if left_out(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not left_out(item)]


SESSION_DIR_PREFIX = "session-"  # tmp_path_factory dirs of session-scoped fixtures: kept to the session's end
_FAILED_FILES: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _FAILED_FILES.add(item.nodeid.split("::")[0])
    return report


@pytest.fixture(scope="module", autouse=True)
def module_dirs_removed(request, tmp_path_factory):
    """What a test file's module-scoped fixtures wrote under the session's temp dir is removed when the file ends
    and none of its tests failed (a whole `make test` kept up to 15 GB, which filled a CI machine's disk). Per-test
    `tmp_path` dirs go at each passing test's end (`tmp_path_retention_policy` in pyproject.toml)."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.nodeid in _FAILED_FILES:
        return
    for path in set(base.iterdir()) - before:
        if path.name.startswith(SESSION_DIR_PREFIX):
            continue
        if path.is_symlink():  # pytest's `<name>current` link to the newest dir of a name
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def pytest_unconfigure(config):
    from tests import launch_ledger

    launch_ledger.unconfigure()


@pytest.fixture(scope="session", autouse=True)
def children_tmpdir(request, tmp_path_factory):
    """The temp dir of every process the tests start (TMPDIR): a session dir under the session's temp dir, removed at
    the session's end unless a test failed. Processes that die by a signal (the kill tests, torchrun's workers) never
    remove what they made in it: wandb's import-time `tmp*wandb-media` / `tmp*wandb-artifacts`, torchrun's
    `torchelastic_*` dirs piled up in /tmp by the hundred. Defined before `rank_pools`: it outlives the pools."""
    path = tmp_path_factory.mktemp(SESSION_DIR_PREFIX + "tmpdir", numbered=False)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    if not request.session.testsfailed:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def rank_pools():
    """The case runner's rank pools (`tests/pool`) end with the session."""
    yield
    from tests import pool

    pool.stop_all()


@pytest.fixture(scope="session")
def embedded_dataset(tmp_path_factory) -> str:
    """The embedded corpus preprocessed with the embedded Mistral tokenizer: a `..._text_document` prefix."""
    from data_tools.assets import DEFAULT_CORPUS
    from data_tools.preprocess import preprocess
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    out = Path(tmp_path_factory.mktemp(SESSION_DIR_PREFIX + "embedded")) / "python_docs"
    preprocess([str(DEFAULT_CORPUS)], str(out), "sentencepiece", str(MISTRAL_TOKENIZER), append_eod=True,
               workers=1)
    return f"{out}_text_document"


@pytest.fixture(scope="session")
def small_datasets(tmp_path_factory) -> dict[str, str]:
    """Small datasets made by `preprocess` from the embedded corpus (with their PREFIX.meta.json):
    `a`, `b` (40 documents each, Mistral SentencePiece, EOD appended) and `gpt2` (a's text with GPT-2 BPE,
    ids up to 50,256). Values are `..._text_document` prefixes."""
    import json

    from data_tools.assets import DEFAULT_CORPUS
    from data_tools.preprocess import preprocess
    from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

    root = Path(tmp_path_factory.mktemp(SESSION_DIR_PREFIX + "small_datasets"))
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        texts = [json.loads(line)["text"][:6000] for line, _ in zip(f, range(80))]
    sp = {"tokenizer_type": "sentencepiece", "tokenizer_model": str(MISTRAL_TOKENIZER)}
    gpt2 = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(GPT2_VOCAB), "merge_file": str(GPT2_MERGES)}
    out = {}
    for name, part, tok in (("a", texts[:40], sp), ("b", texts[40:], sp), ("gpt2", texts[:40], gpt2)):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in part), encoding="utf-8")
        preprocess([str(src)], str(root / name), append_eod=True, progress=False, **tok)
        out[name] = str(root / f"{name}_text_document")
    return out
