"""The model's embedding table covers every id the run's tokenizer makes (called by the data check with the
tokenizer it loaded, `pretrain/data/check.py: check_tokenizer`, and so by `convert from-hf` on the config it writes).

`model.vocab_size` smaller than the tokenizer's vocabulary passed validation and then died in the first step with an
`IndexError`: refused here, naming both sizes, for real data always (a dataset holds the tokenizer's ids), for mock
data when it is below the ids `MockGPTDataset` draws (1 to 4095, and EOD).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.config import ModelConfig
    from pretrain.problems import Report

# Mock documents are ids 1..length-1 (modulo the tokenizer's vocabulary) and EOD, lengths below this: Megatron-Core's
# `MockGPTLowLevelDataset.max_sequence_length` (4096 in 0.16.1 and 0.19.2; tests/pretrain/test_validate.py checks).
MOCK_MAX_SEQUENCE = 4096


def vocab_covers_tokenizer(r: Report, m: ModelConfig, ident, embedded: str | None, mock: bool) -> None:
    """`model.vocab_size` (of the model section `m`, when set) covers the ids the run's data holds: the whole
    vocabulary of the tokenizer the run uses (`ident`, a `TokenizerIdentity`; `embedded` names the embedded tokenizer
    when no file was given), or, for mock data (`mock`), the ids Megatron-Core's `MockGPTDataset` draws from it."""
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
