"""The vocabulary rules: the model's embedding table covers every id the run's tokenizer makes, and the optional
model sizes (null = derived) are positive when given.

`model.vocab_size` smaller than the tokenizer's vocabulary passed validation and then died in the first step
with an `IndexError`. It is refused here, naming both sizes: for real data always (a dataset holds the tokenizer's
ids), for mock data when it is below the ids `MockGPTDataset` draws (1 to 4095, and EOD): that rule needs the
loaded tokenizer, so it lives with the data check (`pretrain/data/vocab.py: vocab_covers_tokenizer`).
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


def optional_sizes_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """`model.vocab_size`, `ffn_hidden_size`, `num_query_groups`, `kv_channels`: null or at least 1."""
    for key in _OPTIONAL_SIZES:
        value = getattr(cfg.model, key)
        if value is not None and value < 1:
            r.error(f"model.{key}", f"model.{key}={value} must be at least 1",
                    f"set model.{key} to a positive integer, or null to derive it")
