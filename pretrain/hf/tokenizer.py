"""The transformers tokenizer written beside exported weights: the run's tokenizer (or the one given)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from model_providers.core.mapping import ConversionError
from pretrain import safe_paths
from pretrain.tokenizer.types import BYTE_BPE, HUGGINGFACE, SENTENCEPIECE, tokenizer_kind


def hf_tokenizer(data_cfg, override: str | None = None):
    """A transformers tokenizer equal to the run's tokenizer (or the one at `override`)."""
    from transformers import AutoTokenizer, GPT2Tokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

    def from_sentencepiece(model: Path):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(model, Path(tmp) / "tokenizer.model")
            return LlamaTokenizer.from_pretrained(tmp)

    def from_path(p: Path):
        if p.is_dir():  # transformers reads the directory's files itself: each is checked first
            from pretrain.hf.assets import has_tokenizer_files

            if not has_tokenizer_files(p):
                raise ConversionError(f"--tokenizer {p}: no tokenizer files there (tokenizer.json, tokenizer.model, "
                                      "vocab.json + merges.txt, ...)")
            try:
                return AutoTokenizer.from_pretrained(str(safe_paths.check_directory(p, "a tokenizer file")),
                                                     local_files_only=True)
            except (OSError, ValueError, TypeError, KeyError) as exc:  # transformers' own refusals, one line
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConversionError(f"--tokenizer {p}: transformers cannot load a tokenizer from it: {first}") \
                    from None
        if p.suffix == ".model":
            return from_sentencepiece(p)
        if p.suffix == ".json":
            return PreTrainedTokenizerFast(tokenizer_file=str(p))
        raise ConversionError(f"--tokenizer {p}: expected a tokenizer directory, tokenizer.json or tokenizer.model")

    if override is not None:
        p = Path(override)
        if not p.exists():
            raise ConversionError(f"--tokenizer {p}: no such file or directory")
        return from_path(p)
    kind = tokenizer_kind(data_cfg.tokenizer_type)
    if kind == SENTENCEPIECE:
        return from_sentencepiece(Path(data_cfg.tokenizer_model or MISTRAL_TOKENIZER))
    if kind == BYTE_BPE or (kind == HUGGINGFACE and data_cfg.vocab_file):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(data_cfg.vocab_file or GPT2_VOCAB, Path(tmp) / "vocab.json")
            shutil.copy(data_cfg.merge_file or GPT2_MERGES, Path(tmp) / "merges.txt")
            return GPT2Tokenizer.from_pretrained(tmp)
    if kind == HUGGINGFACE and data_cfg.tokenizer_model:
        return from_path(Path(data_cfg.tokenizer_model))
    raise ConversionError(f"tokenizer type '{data_cfg.tokenizer_type}' has no transformers equivalent here; "
                          "pass --tokenizer HF_TOKENIZER_DIR")
