"""``megatron.core.tokenizers`` classes over a :class:`TokenizerSpec` (imported lazily: pulls in megatron)."""

from __future__ import annotations

from typing import Any

from megatron.core.tokenizers.text.libraries.abstract_tokenizer import MegatronTokenizerTextAbstract
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

from pretrain.tokenizer.libraries import hf_info, load_sentencepiece, load_tiktoken
from pretrain.tokenizer.spec import TokenizerSpec

# Megatron-Core's tokenizer metadata key for its text-tokenizer class (not which model is trained).
_MEGATRON_MODEL_TYPE = "gpt"  # family-name-ok: megatron.core.tokenizers metadata model_type, not a model family


class HFTokenizersLibrary(MegatronTokenizerTextAbstract):
    """Megatron-Core library adapter over a ``tokenizers.Tokenizer`` (no transformers needed)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        info = hf_info(spec)
        self.tokenizer, self._vocab_size, self._eod = info.tok, info.vocab_size, info.eod
        self._add_special = spec.add_special_tokens

    def text_to_tokens(self, text: str) -> list[str]:
        return self.tokenizer.encode(text, add_special_tokens=self._add_special).tokens

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self.ids_to_text(self.tokens_to_ids(tokens))

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def text_to_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=self._add_special).ids

    def ids_to_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def add_special_tokens(self, special_tokens: Any = None) -> None:
        raise NotImplementedError("adding special tokens is not supported")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def eod(self) -> int | None:
        return self._eod

    eos_id = eod
    bos_id = pad_id = unk_id = mask_id = cls_id = sep_id = property(lambda self: None)

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return []


class SpecTokenizer(MegatronTokenizerText):
    """A ``megatron.core.tokenizers`` text tokenizer built from a :class:`TokenizerSpec`."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        path = spec.model or spec.vocab_file
        kwargs = {"vocab_file": spec.vocab_file, "merges_file": spec.merge_file} if spec.vocab_file else {}
        super().__init__(path, {"library": spec.library, "model_type": _MEGATRON_MODEL_TYPE, "chat_template": None},
                         **kwargs)

    def _restore_model(self, **kwargs: Any) -> Any:
        if self.spec.kind == "sentencepiece":
            from megatron.core.tokenizers.text.libraries import SentencePieceTokenizer

            load_sentencepiece(self.spec)  # a clear error for a bad file
            return SentencePieceTokenizer(self.spec.model)
        if self.spec.kind == "tiktoken":
            return load_tiktoken(self.spec)
        return HFTokenizersLibrary(self.spec)

    @property
    def eod(self) -> int | None:
        if self.spec.kind == "sentencepiece":
            return self._tokenizer.eos_id
        return self._tokenizer.eod


class NullTextTokenizer(MegatronTokenizerText):
    """Megatron-Core's ``NullTokenizer`` (ids only, no files) with ``vocab_size`` ids and EOD the last id, on
    every supported release (0.16's ``NullTokenizer(n)`` has ``n`` ids plus an EOD id ``n``; later releases'
    have ``n`` ids with EOD ``n - 1``: the size is checked, not the version)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, {"library": "null", "model_type": _MEGATRON_MODEL_TYPE, "chat_template": None},
                         vocab_size=int(vocab_size))
        if self.vocab_size != vocab_size or self.eod != vocab_size - 1:
            raise RuntimeError(f"megatron-core's NullTokenizer gave {self.vocab_size} ids with EOD {self.eod}, "
                               f"expected {vocab_size} with EOD {vocab_size - 1}")

    def _restore_model(self, **kwargs: Any) -> Any:
        from megatron.core.tokenizers.text.libraries import NullTokenizer

        size = int(kwargs["vocab_size"])
        lib = NullTokenizer(size)
        return lib if lib.vocab_size == size else NullTokenizer(size - 1)
