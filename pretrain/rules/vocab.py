"""The vocabulary rules: the model's embedding table covers every id the run's tokenizer makes, and the optional
model sizes (null = derived) are positive when given.

`model.vocab_size` smaller than the tokenizer's vocabulary passed validation and then died in the first step
with an `IndexError`. It is refused here, naming both sizes: for real data always (a dataset holds the tokenizer's
ids), for mock data when it is below the ids `MockGPTDataset` draws (1 to 4095, and EOD). The data check
(`pretrain/data/check.py: check_tokenizer`) calls `vocab_covers_tokenizer` with the tokenizer it loaded, and
`convert from-hf` runs the same check on the config it writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.config import Config
    from pretrain.layout import Layout
    from pretrain.problems import Report

# Model sizes that may be null (derived: the tokenizer's vocabulary, 4 × hidden, one group per head, hidden /
# heads) but, when given, must be at least 1 (a 0 was silently read as "derived", a negative crashed later).
_OPTIONAL_SIZES = ("vocab_size", "ffn_hidden_size", "num_query_groups", "kv_channels")
# Mock documents are ids 1..length-1 (modulo the tokenizer's vocabulary) and EOD, lengths below this: Megatron-Core's
# `MockGPTLowLevelDataset.max_sequence_length` (4096 in 0.16.1 and 0.19.2; tests/pretrain/test_validate.py checks).
MOCK_MAX_SEQUENCE = 4096


def optional_sizes_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """`model.vocab_size`, `ffn_hidden_size`, `num_query_groups`, `kv_channels`: null or at least 1."""
    for key in _OPTIONAL_SIZES:
        value = getattr(cfg.model, key)
        if value is not None and value < 1:
            r.error(f"model.{key}", f"model.{key}={value} must be at least 1",
                    f"set model.{key} to a positive integer, or null to derive it")


def vocab_covers_tokenizer(r: Report, cfg: Config, ident, embedded: str | None, mock: bool) -> None:
    """`model.vocab_size` (when set) covers the ids the run's data holds: the whole vocabulary of the tokenizer
    the run uses (`ident`, a `TokenizerIdentity`; `embedded` names the embedded tokenizer when no file was
    given), or, for mock data (`mock`), the ids Megatron-Core's `MockGPTDataset` draws from it."""
    m = cfg.model
    if ident is None or m.vocab_size is None or m.vocab_size < 1:
        return
    which = f"the embedded {embedded.split(' (')[0]}, as data.tokenizer_model is null" if embedded else ident.describe()
    preset = f" (model.preset={m.preset})" if m.preset else ""
    fix = (f"set model.vocab_size >= {ident.vocab_size} (or null: the tokenizer's), or name the model's own "
           "tokenizer in data.tokenizer_type/data.tokenizer_model")
    if not mock:
        if m.vocab_size < ident.vocab_size:
            r.error(("model.vocab_size", "data.tokenizer_model"),
                    f"model.vocab_size={m.vocab_size:,}{preset} is smaller than the tokenizer's vocabulary of "
                    f"{ident.vocab_size:,} ({which}): token ids {m.vocab_size:,} to {ident.vocab_size - 1:,} would "
                    "have no embedding row", fix)
        return
    top = max(min(ident.vocab_size, MOCK_MAX_SEQUENCE) - 1, ident.eod or 0)
    if m.vocab_size <= top:
        r.error(("model.vocab_size", "data.mock", "data.tokenizer_model"),
                f"model.vocab_size={m.vocab_size:,}{preset} is smaller than the tokenizer's vocabulary of "
                f"{ident.vocab_size:,} ({which}), and mock data draws its ids up to {top:,} from it: token ids "
                f"from {m.vocab_size:,} would have no embedding row", fix)
