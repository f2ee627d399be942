"""Which tokenizer a run uses, decided once: `decide` → `TokenizerPlan` (`pretrain.run_plan.RunPlan.tokenizer`).

    plan = decide(cfg.data, cfg.model.vocab_size, mock, cfg.model.preset)   # the run plan's;
    # `load(plan, ...)` builds it as planned

The rules (the one owner of each):
- the embedded fallbacks (Mistral SentencePiece, GPT-2 BPE; `pretrain.tokenizer.embedded`) apply only to the
  SentencePiece types and `GPT2BPETokenizer`; `huggingface` and `tiktoken` need their files,
- except for mock data: without files a null tokenizer of model.vocab_size ids (`pretrain.tokenizer.null`).

The data check reports what the plan found (`pretrain.data.check.check_tokenizer`), the checkpoint contract
compares its identity with the checkpoint's (`pretrain.checkpoint.contract`); neither decides again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pretrain.tokenizer.embedded import with_embedded
from pretrain.tokenizer.null import falls_back_to_null, needs_vocab_size, null_identity


@dataclass(frozen=True)
class TokenizerPlan:
    """Which tokenizer the run uses, decided once: the null tokenizer of mock data without files, or files."""

    null: bool
    identity: Any  # pretrain.tokenizer.identity.TokenizerIdentity; None when it cannot be known (reported)
    error: str | None = None  # why the identity is unknown (None when it is known)
    embedded: str | None = None  # the embedded tokenizer used because no file was given (None: the named files)

    @property
    def vocab_size(self) -> int | None:
        return self.identity.vocab_size if self.identity is not None else None

    @property
    def eod(self) -> int | None:
        return self.identity.eod if self.identity is not None else None

    def record(self) -> dict | None:
        """What a checkpoint records about the tokenizer (None: no tokenizer known)."""
        return self.identity.to_dict() if self.identity is not None else None


def tokenizer_args(d: Any) -> tuple[str, str | None, str | None, str | None, str | None]:
    """(type, model, vocab, merges, embedded) of the tokenizer a `data` section names; `embedded` names the
    embedded tokenizer used because no file was given (None when the section names its files)."""
    return with_embedded(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)


def uses_null_tokenizer(d: Any, mock: bool) -> bool:
    """Mock data (`mock`: `pretrain.data.check.uses_mock`), no tokenizer file, and a type with no embedded
    tokenizer: the run's tokenizer is a null tokenizer of model.vocab_size ids (`pretrain.tokenizer.null`)."""
    return falls_back_to_null(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, mock)


@functools.lru_cache(maxsize=8)
def identity_of(tokenizer_type: str | None, model: str | None, vocab: str | None, merges: str | None):
    """The identity of the tokenizer these `data.tokenizer_*` values name (embedded files where none is given);
    None without a type. Raises `TokenizerError` (or OSError) when its files are unusable."""
    from pretrain.tokenizer.identity import describe_tokenizer

    if tokenizer_type is None:
        return None
    ttype, model, vocab, merges, _ = with_embedded(tokenizer_type, model, vocab, merges)
    return describe_tokenizer(ttype, model, vocab, merges)


def decide(d: Any, vocab_size: int | None, mock: bool, preset: str | None = None) -> TokenizerPlan:
    """The tokenizer of a run with data section `d`, model.vocab_size `vocab_size` (model.preset `preset`, for the
    message) and (`mock`) synthetic data: the named or embedded files (identity None and `error` when they are
    unusable: validation reports why), else the null tokenizer of a mock run without files (its identity None and
    `error` when `vocab_size` is unknown)."""
    from pretrain.tokenizer.identity import describe_tokenizer

    if not uses_null_tokenizer(d, mock):
        ttype, model, vocab, merges, embedded = tokenizer_args(d)
        try:
            identity = describe_tokenizer(ttype, model, vocab, merges)
        except Exception as exc:  # noqa: BLE001 - unusable settings or files: validation reports why, in one line
            return TokenizerPlan(null=False, identity=None, error=str(exc), embedded=embedded)
        return TokenizerPlan(null=False, identity=identity, embedded=embedded)
    if vocab_size:
        return TokenizerPlan(null=True, identity=null_identity(vocab_size))
    return TokenizerPlan(null=True, identity=None, error=needs_vocab_size(d.tokenizer_type, preset))


def load(plan: TokenizerPlan, d: Any, vocab_size: int | None) -> Any:
    """The run's tokenizer as `plan` decided it: the named files, the embedded Mistral / GPT-2 files when no path
    is given, or a null tokenizer of `vocab_size` (model.vocab_size) ids."""
    if plan.null:
        from pretrain.tokenizer.null import null_tokenizer
        from pretrain.tokenizer.types import TokenizerError

        if vocab_size is None:
            raise TokenizerError(plan.error or needs_vocab_size(d.tokenizer_type, None))
        return null_tokenizer(vocab_size)
    from pretrain.tokenizer.load import run_tokenizer

    return run_tokenizer(d)
