"""Fast batch encoders for ``preprocess`` over the tokenizers ``pretrain.tokenizer`` resolves and loads.

:func:`build_batch_encoder` returns the fast batched encoder ``preprocess`` uses. It prefers
``gigatoken`` (when installed and when it reproduces the reference ids on a probe set) and otherwise the
reference library's multi-threaded batch API. Token ids are the same either way, and the same as
:func:`load_tokenizer` (the Megatron-Core tokenizer the trainer uses) gives.

Type names, files and loading live in ``pretrain.tokenizer``; the names below are re-exported from there.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_tools.inputs import TextColumn, as_text_list
from pretrain.tokenizer.libraries import (
    hf_info,
    load_sentencepiece,
    load_tiktoken,
    sentencepiece_vocab_eod,
    tiktoken_vocab_eod,
)
from pretrain.tokenizer.load import load_tokenizer
from pretrain.tokenizer.spec import TokenizerSpec, resolve_spec
from pretrain.tokenizer.types import TOKENIZER_TYPES, TokenizerError

__all__ = ["TOKENIZER_TYPES", "BatchEncoder", "CheckedEncoder", "TokenizerError", "TokenizerSpec",
           "build_batch_encoder", "load_tokenizer", "resolve_spec"]


# --------------------------------------------------------------------------- fast batch encoders


class BatchEncoder:
    """Encodes a list of texts to flat token ids plus offsets; ``name`` says which engine."""

    name = "reference"
    vocab_size: int
    eod: int | None

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(tokens, offsets)``: ``tokens[offsets[i]:offsets[i+1]]`` are the ids of ``texts[i]``."""
        raise NotImplementedError


def _flatten(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets


def _wrap(tokens: np.ndarray, offsets: np.ndarray, prefix: list[int], suffix: list[int]) -> tuple:
    """Insert ``prefix``/``suffix`` ids around every sequence (vectorised)."""
    if not prefix and not suffix:
        return tokens, offsets
    n = offsets.size - 1
    lengths = np.diff(offsets)
    new_lengths = lengths + len(prefix) + len(suffix)
    new_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(new_lengths, out=new_offsets[1:])
    out = np.empty(int(new_offsets[-1]), dtype=np.int64)
    starts = new_offsets[:-1]
    for j, t in enumerate(prefix):
        out[starts + j] = t
    for j, t in enumerate(suffix):
        out[new_offsets[1:] - len(suffix) + j] = t
    body = np.ones(out.size, dtype=bool)
    for j in range(len(prefix)):
        body[starts + j] = False
    for j in range(len(suffix)):
        body[new_offsets[1:] - len(suffix) + j] = False
    out[body] = tokens
    return out, new_offsets


class _LibraryEncoder(BatchEncoder):
    """A tokenizer library with its own multi-threaded batch encoder (`_load`, `_vocab_eod`, `_batch`)."""

    def __init__(self, spec: TokenizerSpec, workers: int) -> None:
        self.lib, self.workers = self._load(spec), workers
        self.vocab_size, self.eod = self._vocab_eod(self.lib)

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten(self._batch(as_text_list(texts)))


class _SentencePieceEncoder(_LibraryEncoder):
    name = "sentencepiece"
    _load, _vocab_eod = staticmethod(load_sentencepiece), staticmethod(sentencepiece_vocab_eod)

    def _batch(self, texts: list[str]) -> list[list[int]]:
        return self.lib.encode(texts, num_threads=self.workers)


class _HFEncoder(BatchEncoder):
    name = "tokenizers"

    def __init__(self, spec: TokenizerSpec, workers: int) -> None:
        info = hf_info(spec)
        self.tok, self.vocab_size, self.eod = info.tok, info.vocab_size, info.eod
        self.prefix, self.suffix = info.prefix, info.suffix

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encs = self.tok.encode_batch_fast(as_text_list(texts), add_special_tokens=False)
        flat, offsets = _flatten([e.ids for e in encs])
        return _wrap(flat, offsets, self.prefix, self.suffix)


class _TiktokenEncoder(_LibraryEncoder):
    name = "tiktoken"
    _load, _vocab_eod = staticmethod(load_tiktoken), staticmethod(tiktoken_vocab_eod)

    def _batch(self, texts: list[str]) -> list[list[int]]:
        return self.lib.tokenizer.encode_batch(texts, num_threads=self.workers, allowed_special="all")


def _gigatoken_sentencepiece(gigatoken: Any, model: str) -> Any:
    """gigatoken for a SentencePiece model, with control pieces (``<s>``, ``</s>``) matched as plain
    text the way ``SentencePieceProcessor.encode`` does; the probe set checks this."""
    try:
        from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

        config = json.loads(sentencepiece_to_tokenizer_json(Path(model).read_bytes()))
        config["added_tokens"] = []
        return gigatoken.Tokenizer.from_json(json.dumps(config))
    except ImportError:  # layout changed: its own loader, with the risky-document re-routing
        return gigatoken.Tokenizer.from_sentencepiece(model)


class _GigatokenEncoder(BatchEncoder):
    name = "gigatoken"

    def __init__(self, spec: TokenizerSpec, reference: BatchEncoder) -> None:
        import gigatoken

        self.spec = spec
        self.vocab_size, self.eod = reference.vocab_size, reference.eod
        self.prefix = getattr(reference, "prefix", [])
        self.suffix = getattr(reference, "suffix", [])
        if spec.kind == "sentencepiece":
            self._make = lambda: _gigatoken_sentencepiece(gigatoken, spec.model)
        elif spec.kind == "bpe-pair":
            hf = reference.tok  # type: ignore[attr-defined]
            self._make = lambda: gigatoken.Tokenizer(hf)
        else:
            self._make = lambda: gigatoken.Tokenizer(spec.model)
        self.tok = self._make()
        # Strings gigatoken splits out as special tokens; the reference libraries do that only for
        # HF added tokens (tokenizer.json), never for SentencePiece pieces or a vocab/merges pair.
        self.risky = () if spec.kind == "hf-json" else tuple(self.tok._special_tokens())

    def reset(self) -> None:
        """Drop the encoder (and its pretoken caches) and build a fresh one."""
        self.tok = None
        self.tok = self._make()

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        # Arrow-backed texts go in as a zero-copy awkward string array (no Python str objects).
        arr = self.tok.encode_batch(texts.awkward() if isinstance(texts, TextColumn) else list(texts), parallel=True)
        layout = arr.layout
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        tokens = np.asarray(layout.content.data)
        if offsets[0] != 0:
            tokens, offsets = tokens[offsets[0] : offsets[-1]], offsets - offsets[0]
        return _wrap(tokens, offsets, self.prefix, self.suffix)


PROBE_TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nmultiple   spaces",
    "Ünïcödé ñ ß 中文字符 日本語 한국어 العربية emoji 🤖🚀 ́combining",
    "<|endoftext|> </s> <s> [INST] special-looking text [/INST]",
    "<unk> <pad> <mask> <s>x</s>",
    "numbers 1234567890 3.14159 1e-9 0x1F",
    "code: def f(x):\n    return x**2  # comment\n",
    "\u200b zero\u00a0width\u2028separators\ufeff",
    "a" * 3000,
    "",
]


_PROBE_DOC_CHARS = 4000  # corpus documents are cut: the reference library is slow on long ones


def _probe_texts() -> list[str]:
    texts = list(PROBE_TEXTS)
    try:
        from data_tools.assets import DEFAULT_CORPUS

        with open(DEFAULT_CORPUS, encoding="utf-8") as f:
            for _ in range(12):
                line = f.readline()
                if not line:
                    break
                texts.append(json.loads(line)["text"][:_PROBE_DOC_CHARS])
    except (OSError, ValueError, KeyError):
        pass
    return texts


def _same_ids(a: BatchEncoder, b: BatchEncoder, texts: Sequence[str]) -> bool:
    ta, oa = a.encode(texts)
    tb, ob = b.encode(texts)
    return bool(np.array_equal(oa, ob) and np.array_equal(ta.astype(np.int64), tb.astype(np.int64)))


def _splice(
    tokens: np.ndarray, offsets: np.ndarray, rows: list[int], fixed: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Replace the ids of documents ``rows`` with ``fixed`` (tokens, offsets of those rows)."""
    pieces = np.split(np.asarray(tokens, dtype=np.int64), offsets[1:-1])
    ftok, foff = fixed
    for j, r in enumerate(rows):
        pieces[r] = ftok[foff[j] : foff[j + 1]]
    lengths = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
    new_offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int64)), new_offsets


class CheckedEncoder(BatchEncoder):
    """gigatoken guarded by the reference library.

    Documents that contain a string gigatoken treats as a special token but the reference does
    not (e.g. a literal ``</s>`` for SentencePiece) go to the reference encoder; one document per
    batch is spot-checked, and at the first disagreement the batch is re-encoded with the
    reference, which is used for the rest of the run.
    """

    def __init__(self, fast: BatchEncoder, reference: BatchEncoder, log: Any = None) -> None:
        self.fast: BatchEncoder | None = fast
        self.reference = reference
        self.vocab_size, self.eod = reference.vocab_size, reference.eod
        self.risky: tuple[str, ...] = tuple(getattr(fast, "risky", ()))
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self._batches = 0
        self.mismatches = 0
        self.rerouted = 0

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.fast.name if self.fast is not None else self.reference.name

    def reset(self) -> None:
        """Drop gigatoken's caches (bounded memory on unbounded input)."""
        if self.fast is not None:
            self.fast.reset()  # type: ignore[attr-defined]

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.fast is None or not texts:
            return self.reference.encode(texts)
        tokens, offsets = self.fast.encode(texts)
        if self.risky:
            if isinstance(texts, TextColumn):
                rows = texts.rows_containing(self.risky)
            else:
                rows = [i for i, t in enumerate(texts) if any(r in t for r in self.risky)]
            if rows:
                self.rerouted += len(rows)
                tokens, offsets = _splice(tokens, offsets, rows, self.reference.encode([texts[i] for i in rows]))
        i = (self._batches * 7919) % len(texts)
        self._batches += 1
        # Spot-check (a bounded prefix of) one document.
        sample = texts[i][:4096]
        ref_t, _ = self.reference.encode([sample])
        got = tokens[offsets[i] : offsets[i + 1]] if len(sample) == len(texts[i]) else self.encode_one(sample)
        if not np.array_equal(np.asarray(got, dtype=np.int64), ref_t.astype(np.int64)):
            self.mismatches += 1
            ref = self.reference.name
            self._log(f"warning: gigatoken disagrees with {ref} on a document; using {ref} from here on")
            self.fast = None
            return self.reference.encode(texts)
        return tokens, offsets

    def encode_one(self, text: str) -> np.ndarray:
        if any(r in text for r in self.risky):
            return self.reference.encode([text])[0]
        return self.fast.encode([text])[0]  # type: ignore[union-attr]


def build_batch_encoder(spec: TokenizerSpec, workers: int = 1, engine: str = "auto", log: Any = None) -> BatchEncoder:
    """The fastest encoder giving the reference ids: ``engine`` is ``auto``, ``gigatoken`` or ``reference``."""
    if engine not in ("auto", "gigatoken", "reference"):
        raise ValueError(f"unknown encoder engine {engine!r}")
    reference: BatchEncoder
    if spec.kind == "sentencepiece":
        reference = _SentencePieceEncoder(spec, workers)
    elif spec.kind == "tiktoken":
        return _TiktokenEncoder(spec, workers)
    else:
        reference = _HFEncoder(spec, workers)
    if engine == "reference":
        return reference
    try:
        fast = _GigatokenEncoder(spec, reference)
    except ImportError:
        if engine == "gigatoken":
            raise TokenizerError("--encoder gigatoken requested but the gigatoken package is not installed") from None
        return reference
    except Exception as e:  # an unsupported model layout: use the reference library
        if engine == "gigatoken":
            raise TokenizerError(f"gigatoken cannot load this tokenizer: {e}") from e
        return reference
    checked = CheckedEncoder(fast, reference, log)
    try:
        same = _same_ids(checked, reference, _probe_texts()) and checked.fast is not None
    except Exception:  # noqa: BLE001 - any failure means "do not trust it"
        same = False
    if not same:
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"note: gigatoken ids differ from {reference.name} on the probe set; using {reference.name}"
        )
        return reference
    checked._batches = 0
    return checked
