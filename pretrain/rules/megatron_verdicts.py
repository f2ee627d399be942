"""The verdict cache of Megatron-Core's own config checks (`pretrain.rules.megatron`): a warm `validate` of an
unchanged config need not import torch and megatron-core (2–3 s of a 4 s check) to build the same
`TransformerConfig` / `OptimizerConfig` / `GPTDatasetConfig` again.

An entry records that those checks *accepted* one exact input, and is keyed by all of it: which checks ran, the
whole resolved config (its YAML), the world size, the derived `Layout`, whether this machine has CUDA and uses
Transformer Engine, the installed Python / megatron-core / Transformer Engine / torch versions, the size and
mtime of megatron-core's config modules, and the contents of every source file of `pretrain/` and
`model_providers/` (the code that builds those objects). Any change to any of them is another key: that check
runs again. A refusal is never cached (it is re-checked and printed each time).

Entries live beside the data check's verdicts, in `data.cache_dir` (default `run.dir/data_cache`) under
`megatron_checks/`, one small JSON file each; they are written only when the whole validation passed
(`pretrain.validate.store_verdicts`, with the data check's), by `validate` only into a cache directory that
exists. The cache is read only by a process that has not imported megatron-core yet (the `validate` CLI):
where it is imported (the trainer, the tests' workers), running the checks costs milliseconds and they always run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.files import write_atomic

if TYPE_CHECKING:
    from pretrain.config import Config
    from pretrain.layout import Layout

VERDICT_DIR = "megatron_checks"
VERDICT_FORMAT = "megapretrain-megatron-check"
VERDICT_VERSION = 1
# Megatron-Core's modules whose classes the checks build (their __post_init__ asserts are the checks).
_MCORE_FILES = ("megatron/core/transformer/transformer_config.py", "megatron/core/model_parallel_config.py",
                "megatron/core/optimizer/optimizer_config.py",
                "megatron/core/datasets/blended_megatron_dataset_config.py", "megatron/core/datasets/gpt_dataset.py")
_SOURCE_PACKAGES = ("pretrain", "model_providers")


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """sha256 over the path and contents of every .py file of this program's packages, where they are imported
    from (found, not imported); a file that cannot be read makes a digest no entry matches."""
    import importlib.util

    digest = hashlib.sha256()
    try:
        for package in _SOURCE_PACKAGES:
            spec = importlib.util.find_spec(package)
            for where in (spec.submodule_search_locations or []) if spec else []:
                root = Path(where)
                for path in sorted(root.rglob("*.py")):
                    digest.update(f"{package}/{path.relative_to(root)}".encode())
                    digest.update(path.read_bytes())
    except OSError:
        return f"unreadable {os.urandom(16).hex()}"
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _mcore_stamps() -> tuple[Any, ...]:
    """(path, size, mtime_ns) of megatron-core's config modules (an edited install is another key)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("megatron-core")
    except metadata.PackageNotFoundError:
        return ()
    out = []
    for name in _MCORE_FILES:
        try:
            st = os.stat(dist.locate_file(name))
            out.append([name, st.st_size, st.st_mtime_ns])
        except OSError:
            out.append([name, None, None])
    return tuple(out)


def verdict_key(kinds: list[str], cfg: Config, lay: Layout | None, world: int, cuda: bool,
                te_on_gpu: bool) -> tuple[str, dict[str, Any]]:
    """(key, the facts it is the digest of) for the checks `kinds` of this exact input."""
    from pretrain.compat import matrix

    facts = {"format": VERDICT_FORMAT, "version": VERDICT_VERSION, "checks": list(kinds), "world": world,
             "cuda": cuda, "te_on_gpu": te_on_gpu, "layout": repr(lay), "config": cfg.to_dict(),
             "installed": matrix.installed().summary(), "megatron_core_files": [list(x) for x in _mcore_stamps()],
             "code": _code_digest()}
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40], json.loads(text)  # as an entry reads back


def entry_path(cache_dir: str | os.PathLike, key: str, directory: str = VERDICT_DIR) -> Path:
    return Path(cache_dir) / directory / f"{key}.json"


def usable() -> bool:
    """The cache is consulted only where megatron-core is not imported yet (there the checks are cheap)."""
    return "megatron.core" not in sys.modules


def lookup(cache_dir: str | os.PathLike, key: str, facts: dict[str, Any]) -> Path | None:
    """The entry's path when it is present, well-formed and records exactly `facts` as accepted; else None."""
    return entry_path(cache_dir, key) if read_entry(cache_dir, key, facts) is not None else None


def read_entry(cache_dir: str | os.PathLike, key: str, facts: dict[str, Any],
               directory: str = VERDICT_DIR) -> dict[str, Any] | None:
    """The entry (`{"verdict", "facts", "result"?}`) when it is present, well-formed and records exactly `facts` as
    accepted; else None. `directory`: another cache beside this one (`pretrain.rules.start`'s resume verdicts)."""
    path = entry_path(cache_dir, key, directory)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("verdict") != "accepted" or record.get("facts") != facts:
        return None
    return record


def store(cache_dir: str | os.PathLike, verdicts: list[tuple], create: bool, directory: str = VERDICT_DIR) -> int:
    """Write each (key, facts) or (key, facts, result) as accepted; `create=False`: only into a cache directory
    that exists. Returns how many were written (a cache that cannot be written is no error: the checks run again
    next time)."""
    if not verdicts or (not create and not os.path.isdir(cache_dir)):
        return 0
    written = 0
    for key, facts, *result in verdicts:
        path = entry_path(cache_dir, key, directory)
        record = {"verdict": "accepted", "facts": facts, **({"result": result[0]} if result else {})}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(record, sort_keys=True), durable=False)
            written += 1
        except OSError:
            continue
    return written
