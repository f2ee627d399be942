"""The data section of pre-flight validation: blends, split, tokenizer and every dataset file, checked before
any process group or model exists, every problem reported at once. It only checks: the blends were parsed and the
tokenizer decided when the run was planned (`pretrain.data.plan.DataPlan`, `pretrain.tokenizer.choice.TokenizerPlan`).

Rules checked here:
- data present (a blend or mock data), one way of giving blends, the blends' syntax (as the plan parsed them), the
  split, and the files a tokenizer type needs (`huggingface` and `tiktoken` embed none);
- the tokenizer the plan chose: readable, covered by the model's vocabulary, with an EOD where documents need one;
- every prefix: files present, index header/version/dtype/pointers, `.bin` size, `PREFIX.meta.json` counts
  and tokenizer (`data.allow_tokenizer_mismatch` overrides), largest token id below the model's vocabulary
  (from the metadata; without it a chunked scan of `.bin` files up to `SCAN_LIMIT_BYTES`), and documents in
  every split the run reads (Megatron-Core loops forever on a split without tokens).
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING

from pretrain.config_parse import shown
from pretrain.data.plan import DataPlan, eval_is_on, parse_blend, uses_mock  # noqa: F401 (also imported from here)
from pretrain.data.vocab import vocab_covers_tokenizer
from pretrain.dataset_format.verdicts import entry as verdict_entry
from pretrain.tokenizer.null import describe_null, null_identity
from pretrain.tokenizer.types import HUGGINGFACE, TIKTOKEN, tokenizer_kind

if TYPE_CHECKING:
    from pretrain.config import DataConfig, ModelConfig, TrainConfig
    from pretrain.problems import Report
    from pretrain.tokenizer.choice import TokenizerPlan

SCAN_LIMIT_BYTES = 1 << 30  # .bin files without metadata up to this size are scanned for their largest id
CHECK_THREADS = 16  # prefixes checked at once
SPLIT_NAMES = ("training", "validation", "test")


def split_ranges(split: str) -> list[tuple[float, float] | None]:
    """Megatron's split matrix for a `data.split` string: [start, end) fractions per split, None for a split
    with no share. Raises ValueError for a malformed string."""
    parts = [x.strip() for x in re.split(r"[,/]", str(split))]
    bad = [x for x in parts if not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", x)]
    if bad:  # Megatron-Core's own parser keeps the numbers it finds and silently drops the rest
        raise ValueError(f"data.split={shown(split)}: {shown(bad[0])} is not a share (a non-negative number); "
                         "write up to three shares separated by commas, e.g. '969,30,1'")
    values = [float(x) for x in parts]
    if not values or len(values) > 3 or sum(values) <= 0:
        raise ValueError(f"data.split={shown(split)} must be up to three non-negative shares, e.g. '969,30,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    ranges, start = [], 0.0
    for v in values:
        end = start + v / total
        ranges.append((start, end) if end > start else None)
        start = end
    return ranges


def check_data_config(data: DataPlan, tokenizer: TokenizerPlan, t: TrainConfig, r: Report) -> None:
    """Rules that need no file: data present, mock vs blend, blend syntax (the plan's parse), split, the files the
    tokenizer type needs (`tokenizer`: the plan's choice; `t`: the train section, for evaluation)."""
    d = data.config
    if not d.mock and not d.blend and not d.train_blend:
        r.error(("data.blend", "data.mock"), "no training data: data.blend and data.train_blend are empty and "
                "data.mock is false", "set data.blend=[PREFIX] (from `python -m data_tools preprocess`) or "
                "data.mock=true")
    if d.mock and not uses_mock(d):
        r.notes.append("data.mock=true is ignored because a blend is given: training reads the blend (mock data "
                       "is used only without one, as Megatron-LM's --mock-data)")
    if d.train_blend and d.blend:
        r.error(("data.blend", "data.train_blend"), "set either data.blend (with data.split) or per-split blends "
                "(data.train_blend, ...), not both", "remove one of them")
    for key, message, fix in data.blend_problems:
        r.error(key, message, fix)
    try:  # checked even where no blend reads it: a malformed split is still a mistake
        ranges = split_ranges(d.split)
    except ValueError as e:
        ranges = None
        r.error("data.split", str(e), "set data.split like '969,30,1' (training, validation, test shares)")
    if "data.blend" in data.blends and ranges is not None:
        if ranges[0] is None:
            r.error("data.split", f"data.split={d.split!r} gives the training split no share",
                    "give training a share, e.g. '969,30,1'")
        if eval_is_on(t) and ranges[1] is None:
            r.error(("data.split", "train.eval_interval"), f"evaluation is on (train.eval_interval="
                    f"{t.eval_interval}) but data.split={d.split!r} gives the validation split no share",
                    "give validation a share (e.g. '969,30,1') or set train.eval_interval=null")
    kind = None if tokenizer.null else tokenizer_kind(d.tokenizer_type)
    if kind == HUGGINGFACE and d.tokenizer_model is None and d.vocab_file is None:
        r.error(("data.tokenizer_type", "data.tokenizer_model"), f"data.tokenizer_type={d.tokenizer_type} needs "
                "data.tokenizer_model (a tokenizer.json or its directory); no HuggingFace tokenizer is embedded",
                "set data.tokenizer_model to the model's tokenizer (e.g. the Llama-3 tokenizer directory)")
    if kind == TIKTOKEN and d.tokenizer_model is None:
        r.error(("data.tokenizer_type", "data.tokenizer_model"), f"data.tokenizer_type={d.tokenizer_type} needs "
                "data.tokenizer_model (a Megatron tiktoken .json)", "set data.tokenizer_model")


def _tokenizer_problem_reported(r: Report) -> bool:
    return any("data.tokenizer_type" in p.keys for p in r.errors)


def check_tokenizer(tokenizer: TokenizerPlan, d: DataConfig, m: ModelConfig, r: Report):
    """Report what the plan found of the run's tokenizer (`tokenizer`; `d`, `m`: the data and model sections):
    unusable files, a silent fallback, a missing EOD. Returns its `TokenizerIdentity`, or None when it cannot be
    loaded."""
    if _tokenizer_problem_reported(r):
        return None
    if tokenizer.null:
        return _null_tokenizer(tokenizer, d, m, r)
    ident, embedded = tokenizer.identity, tokenizer.embedded
    if ident is None:
        r.error(("data.tokenizer_type", "data.tokenizer_model"), f"tokenizer: {tokenizer.error}",
                "point data.tokenizer_model (or data.vocab_file/data.merge_file) at readable tokenizer files")
        return None
    vocab_covers_tokenizer(r, m, ident, embedded, uses_mock(d))
    if embedded and m.vocab_size and m.vocab_size > ident.vocab_size:
        preset = f" (model.preset={m.preset})" if m.preset else ""
        msg = (f"model.vocab_size={m.vocab_size}{preset} but data.tokenizer_model is null, so the embedded "
               f"{embedded} tokenizer would be used")
        if uses_mock(d):
            r.notes.append(f"{msg}: fine for synthetic tokens; name the model's tokenizer for a real run")
        else:
            r.error(("data.tokenizer_model", "model.vocab_size"), msg,
                    "set data.tokenizer_type and data.tokenizer_model to the tokenizer the model is meant for")
    if uses_mock(d) and ident.eod is None:
        r.error(("data.mock", "data.tokenizer_model"), f"mock data ends every document with the tokenizer's EOD "
                f"token, but {ident.describe()} defines none", "use a tokenizer with an EOS token (for a "
                "tokenizer.json: eos_token in tokenizer_config.json beside it)")
    document_options = [f"data.{k}" for k in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
                        if getattr(d, k)]
    if document_options and ident.eod is None:
        r.error((*document_options, "data.tokenizer_model"), f"{'=true, '.join(document_options)}=true: document "
                f"boundaries are the tokenizer's EOD tokens, but {ident.describe()} defines none, so this would do "
                "nothing", "use a tokenizer with an EOS token (for a tokenizer.json: eos_token in "
                f"tokenizer_config.json beside it), or set {'=false '.join(document_options)}=false")
    return ident


def _null_tokenizer(tokenizer: TokenizerPlan, d: DataConfig, m: ModelConfig, r: Report):
    """The identity of the null tokenizer a mock run without tokenizer files uses (one note), or None with the
    plan's error when the model's vocabulary size is unknown."""
    if tokenizer.identity is None:
        r.error(("data.tokenizer_model", "model.vocab_size"), tokenizer.error,
                "set model.vocab_size, or data.tokenizer_model to the model's tokenizer")
        return None
    source = f"model.preset={m.preset}'s model.vocab_size" if m.preset else "model.vocab_size"
    r.notes.append(f"data.mock=true and no tokenizer file for data.tokenizer_type={d.tokenizer_type}: training uses "
                   f"{describe_null(m.vocab_size)} from {source}; a real blend needs data.tokenizer_model")
    return null_identity(m.vocab_size)


def _checked(prefix: str, verdict_cache: str | None = None, header_only: bool = False):
    """`check_dataset` of one prefix (the metadata check where it can stand for the index, else a current entry
    of the verdict cache `verdict_cache`, else a full read; `header_only`: the header check instead of the full
    read), or its exception."""
    from pretrain.dataset_format.check import check_dataset

    try:
        return check_dataset(prefix, scan_limit_bytes=SCAN_LIMIT_BYTES, trust_metadata=True,
                             verdict_cache=verdict_cache, header_only=header_only)
    except (ValueError, OSError) as e:
        return e


def check_all(prefixes: list[str], verdict_cache: str | None = None, header_only: bool = False) -> dict:
    """`_checked` of every prefix, CHECK_THREADS at a time (a parallel file system answers many small reads at
    once; each check is a few opens and 128 KiB)."""
    if len(prefixes) < 2:
        return {p: _checked(p, verdict_cache, header_only) for p in prefixes}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(CHECK_THREADS, len(prefixes))) as pool:
        return dict(zip(prefixes, pool.map(lambda p: _checked(p, verdict_cache, header_only), prefixes)))


def _check_prefix(d: DataConfig, r: Report, key: str, prefix: str, ident, vocab: int | None, checked):
    """One dataset prefix: files, format, metadata, tokenizer and largest id (`checked`: its `_checked`; `d`: the
    data section). Returns its facts or None."""
    from pretrain.dataset_format.indexed import bin_path, idx_path, prefix_hint
    from pretrain.dataset_format.metadata import meta_path

    missing = [str(p) for p in (idx_path(prefix), bin_path(prefix)) if not os.path.isfile(p)]
    if missing:
        r.error(key, f"{prefix}: no dataset there ({' and '.join(missing)} not found){prefix_hint(prefix)}",
                "give the prefix of a .bin/.idx pair from `python -m data_tools preprocess`, without extension")
        return None
    try:
        if isinstance(checked, BaseException):
            raise checked
        facts = checked
    except ValueError as e:  # IndexedFormatError, MetadataError: the message names the file
        r.error(key, str(e), f"re-create the dataset (`python -m data_tools verify {prefix}` checks it)")
        return None
    except OSError as e:
        r.error(key, f"{prefix}: cannot be read ({e.strerror}: {e.filename})", "check the path and permissions")
        return None
    if facts.meta is None:
        r.warnings.append(f"{prefix} has no {meta_path(prefix).name} (made by another tool?): its tokenizer cannot "
                          "be checked against the run's")
    elif ident is not None:
        made = facts.tokenizer
        if made.sha256 != ident.sha256:
            msg = f"{prefix} was made with {made.describe()} but this run uses {ident.describe()}"
            if d.allow_tokenizer_mismatch:
                r.warnings.append(f"{msg}; allowed by data.allow_tokenizer_mismatch=true")
            else:
                r.error((key, "data.tokenizer_model"), msg, "preprocess the data with the run's tokenizer, set "
                        "data.tokenizer_* to the dataset's, or set data.allow_tokenizer_mismatch=true if you know "
                        "the ids mean the same")
    if vocab is not None and facts.max_token_id is not None and facts.max_token_id >= vocab:
        where = meta_path(prefix).name if facts.max_id_from == "metadata" else f"a scan of {bin_path(prefix).name}"
        r.error((key, "model.vocab_size"), f"{prefix}: largest token id {facts.max_token_id:,} (from {where}) is "
                f"not below the model's vocabulary of {vocab:,}", "train with the tokenizer the data was made with "
                "(or a model.vocab_size above its largest id)")
    elif vocab is not None and facts.max_id_from == "unchecked":
        r.ids_unchecked = True
        r.notes.append(f"{prefix}: no metadata and {bin_path(prefix).stat().st_size / 2**30:.1f} GiB, so its token "
                       "ids are checked batch by batch while training instead of up front")
    return facts


def _empty_split(prefix: str, facts, rng: tuple[float, float] | None) -> tuple[int, int]:
    """(documents, tokens) of `prefix` in the split range `rng` (Megatron-Core's document bookends); the tokens
    from two sequence pointers, so a large index is not read."""
    from pretrain.dataset_format.indexed import tokens_between

    n = facts.info.num_documents
    if rng is None:
        return 0, 0
    beg, end = int(round(rng[0] * float(n))), int(round(rng[1] * float(n)))
    return end - beg, tokens_between(facts.info, beg, end)


def check_data_files(data: DataPlan, tokenizer: TokenizerPlan, m: ModelConfig, r: Report,
                     header_only: bool = False) -> None:
    """Tokenizer, every prefix of every blend, and the documents of each split the run reads (`data`, `tokenizer`:
    the run plan's; `m`: the model section). `header_only` (`validate`): a
    dataset whose metadata cannot stand for its index, and that has no verdict of an earlier full read, is checked
    from its .idx header and sizes (a few reads at any size), not read in full: the trainer's one-rank check reads
    it in full before training reads it."""
    from pretrain.dataset_format.check import full_read_note

    d, eval_on = data.config, data.eval_on
    ident = check_tokenizer(tokenizer, d, m, r)
    vocab = (m.vocab_size or ident.vocab_size) if ident is not None else m.vocab_size
    try:
        ranges = split_ranges(d.split)
    except ValueError:
        ranges = None  # reported by check_data_config
    seen: dict[str, object] = {}
    started = time.perf_counter()
    checked = check_all(list(dict.fromkeys(p for prefixes, _ in data.blends.values() for p in prefixes)),
                        data.cache_dir, header_only)
    for key, (prefixes, _weights) in data.blends.items():
        for prefix in prefixes:
            if prefix not in seen:
                seen[prefix] = _check_prefix(d, r, key, prefix, ident, vocab, checked[prefix])
            facts = seen[prefix]
            if facts is None:
                continue
            if key == "data.blend":
                needed = [(i, ranges[i]) for i in ((0, 1) if eval_on else (0,))] if ranges else []
            elif key == "data.train_blend" or (key == "data.valid_blend" and eval_on):
                needed = [(0 if key == "data.train_blend" else 1, (0.0, 1.0))]
            else:
                needed = []
            for i, rng in needed:
                if rng is None:
                    continue  # a split with no share is reported by check_data_config
                docs, tokens = _empty_split(prefix, facts, rng)
                if tokens == 0:
                    where = f"data.split={d.split!r} leaves" if key == "data.blend" else "that leaves"
                    r.error((key, "data.split") if key == "data.blend" else key,
                            f"{prefix}: {facts.info.num_documents} document(s); {where} the {SPLIT_NAMES[i]} split "
                            f"{docs} document(s) with {tokens} tokens, and Megatron-Core cannot sample from an empty "
                            "split", "add documents, change data.split, or use per-split blends (data.train_blend, "
                            "data.valid_blend)" + (" or set train.eval_interval=null" if i == 1 else ""))
    checked = [f for f in seen.values() if f is not None]
    full_read = full_read_note(checked)
    if full_read:
        r.notes.append(full_read)
    r.data_verdicts += [e for f in checked if (e := verdict_entry(f)) is not None]
    if seen:
        fast, cached, header = (sum(f.checked == how for f in checked) for how in ("metadata", "cache", "header"))
        headers = f"{header} from their .idx header and sizes, " if header_only else ""
        if header:
            r.notes.append(f"{header} dataset(s) whose metadata cannot stand for their index were checked from the "
                           ".idx header, the first and last pointers and the file sizes; the trainer's one-rank "
                           "check reads them in full before training reads them (once: its verdict is cached), "
                           "`python -m data_tools verify PREFIX` does now")
        r.notes.append(f"dataset files checked: {len(seen)} prefix(es) in {time.perf_counter() - started:.2f} s "
                       f"({fast} from their metadata and .idx header, {cached} from the verdict cache, {headers}"
                       f"{len(checked) - fast - cached - header} read in full)")


def store_verdicts(cache_dir: str, r: Report, create: bool = True) -> int:
    """Write the verdicts of this check's full reads (`r.data_verdicts`) into the verdict cache beside Megatron's
    index caches, once the whole validation passed (`create=False`: only into a cache directory that exists, as
    `validate` does). Returns how many were written."""
    from pretrain.dataset_format.verdicts import store

    if r.errors:
        return 0
    return store(cache_dir, r.data_verdicts, create=create)
