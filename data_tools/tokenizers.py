"""Tokenizers for data_tools and the trainer: one resolution of user arguments, two faces.

* :func:`load_tokenizer` returns a ``megatron.core.tokenizers`` object (what ``GPTDataset`` and
  the trainer use): SentencePiece and tiktoken through Megatron-Core's own library classes, HF
  tokenizers through a thin adapter over the ``tokenizers`` library.
* :func:`build_batch_encoder` returns the fast batched encoder ``preprocess`` uses. It prefers
  ``gigatoken`` (when installed and when it reproduces the reference ids on a probe set) and
  otherwise the reference library's multi-threaded batch API. Token ids are the same either way.

Semantics follow Megatron-LM's ``--tokenizer-type`` names so existing commands carry over:

============================  ===============================================  =========================
type                          model files                                      EOD / special tokens
============================  ===============================================  =========================
sentencepiece,                ``--tokenizer-model tokenizer.model``            EOD = model's EOS id,
GPTSentencePieceTokenizer                                                      no BOS added
huggingface,                  ``--tokenizer-model`` dir with ``tokenizer.json``  EOD = ``eos_token`` of
HuggingFaceTokenizer          (+ ``tokenizer_config.json``) or the file        ``tokenizer_config.json``;
                                                                               post-processor specials
                                                                               (e.g. BOS) are added
huggingface (pair),           ``--vocab-file vocab.json --merge-file           EOD = ``<|endoftext|>``,
GPT2BPETokenizer              merges.txt``                                     no specials in text
tiktoken, TikTokenizer        Megatron tiktoken ``.json`` vocabulary           Megatron-Core
                                                                               ``TikTokenTokenizer``
============================  ===============================================  =========================
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_tools.inputs import TextColumn, as_text_list

_TYPE_ALIASES = {
    "sentencepiece": "sentencepiece",
    "gptsentencepiecetokenizer": "sentencepiece",
    "huggingface": "huggingface",
    "huggingfacetokenizer": "huggingface",
    "gpt2bpetokenizer": "gpt2bpe",
    "tiktoken": "tiktoken",
    "tiktokenizer": "tiktoken",
}
TOKENIZER_TYPES = (
    "sentencepiece",
    "huggingface",
    "tiktoken",
    "GPTSentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
)
GPT2_EOD_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer type or file that cannot be used; the message names the path."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A resolved tokenizer: which family, which files, and how ids are produced."""

    kind: str  # "sentencepiece" | "hf-json" | "bpe-pair" | "tiktoken"
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eos_token: str | None = None  # hf-json: the EOS named in tokenizer_config.json
    add_special_tokens: bool = False  # hf-json: Megatron-LM's HuggingFaceTokenizer adds them

    @property
    def library(self) -> str:
        return {"sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}.get(self.kind, "huggingface")


def _need_file(path: str | os.PathLike | None, what: str) -> str:
    if path is None:
        raise TokenizerError(f"{what} is required but was not given")
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"{what} not found: {p}")
    if not p.is_file():
        raise TokenizerError(f"{what} is not a file: {p}")
    if not os.access(p, os.R_OK):
        raise TokenizerError(f"{what} is not readable: {p}")
    return os.fspath(p)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_from_config(model_dir: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = model_dir / name
        if cfg.is_file():
            try:
                eos = _token_content(json.loads(cfg.read_text(encoding="utf-8")).get("eos_token"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{cfg}: not valid JSON ({e})") from e
            if eos:
                return eos
    return None


def resolve_spec(
    tokenizer_type: str,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
) -> TokenizerSpec:
    """Validate user arguments (types and files) and return a :class:`TokenizerSpec`."""
    kind = _TYPE_ALIASES.get(str(tokenizer_type).lower())
    if kind is None:
        raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if kind == "sentencepiece":
        return TokenizerSpec("sentencepiece", model=_need_file(tokenizer_model, "SentencePiece --tokenizer-model"))
    if kind == "tiktoken":
        return TokenizerSpec("tiktoken", model=_need_file(tokenizer_model, "tiktoken --tokenizer-model (.json)"))
    if kind == "gpt2bpe" or (tokenizer_model is None and vocab_file is not None):
        return TokenizerSpec(
            "bpe-pair",
            vocab_file=_need_file(vocab_file, "--vocab-file (vocab.json)"),
            merge_file=_need_file(merge_file, "--merge-file (merges.txt)"),
        )
    if tokenizer_model is None:
        raise TokenizerError("huggingface tokenizer needs --tokenizer-model (tokenizer.json or its directory)")
    model = Path(tokenizer_model)
    if model.is_dir():
        model = model / "tokenizer.json"
        if not model.is_file():
            raise TokenizerError(f"{tokenizer_model}: directory holds no tokenizer.json")
    model_path = _need_file(model, "HuggingFace --tokenizer-model")
    return TokenizerSpec("hf-json", model=model_path, eos_token=_eos_from_config(model.parent), add_special_tokens=True)


# --------------------------------------------------------------------------- reference libraries


def _load_sentencepiece(spec: TokenizerSpec) -> Any:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(spec.model)
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{spec.model}: not a SentencePiece model ({e})") from e
    return sp


def _load_hf(spec: TokenizerSpec) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if spec.kind == "bpe-pair":
        try:
            tok = Tokenizer(BPE.from_file(spec.vocab_file, spec.merge_file))
        except Exception as e:  # the Rust loader raises plain Exception
            raise TokenizerError(f"{spec.vocab_file} / {spec.merge_file}: not a BPE vocab/merges pair ({e})") from e
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        try:
            tok = Tokenizer.from_file(spec.model)
        except Exception as e:
            raise TokenizerError(f"{spec.model}: not a HuggingFace tokenizer.json ({e})") from e
    tok.no_truncation()
    tok.no_padding()
    return tok


def _tiktoken_vocab_size(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not a Megatron tiktoken JSON vocabulary ({e})") from e
    if not isinstance(vocab, list) or not vocab:
        raise TokenizerError(f"{path}: expected a JSON list of {{rank, token_bytes, token_str}} entries")
    return min(2**17, len(vocab) + 1000)


def _load_tiktoken(spec: TokenizerSpec) -> Any:
    """Megatron-Core's TikTokenTokenizer (default special tokens, pattern v2)."""
    from megatron.core.tokenizers.text.libraries import TikTokenTokenizer

    vocab_size = _tiktoken_vocab_size(spec.model)  # its own clear TokenizerError
    try:
        return TikTokenTokenizer(spec.model, vocab_size=vocab_size)
    except (AssertionError, KeyError, ValueError) as e:
        raise TokenizerError(f"{spec.model}: not a Megatron tiktoken JSON vocabulary ({e!r})") from e


def _hf_special_affixes(tok: Any) -> tuple[list[int], list[int]]:
    """Ids the post-processor adds around a single sequence (e.g. BOS), as (prefix, suffix)."""
    for probe in ("x", "Hello world"):
        plain = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        for k in range(len(full) - len(plain) + 1):
            if full[k : k + len(plain)] == plain:
                prefix, suffix = full[:k], full[k + len(plain) :]
                break
        else:
            raise TokenizerError("the tokenizer's post-processor is not a simple prefix/suffix template")
    return prefix, suffix


@dataclass
class _HFInfo:
    tok: Any
    vocab_size: int
    eod: int | None
    prefix: list[int]
    suffix: list[int]


def _hf_info(spec: TokenizerSpec) -> _HFInfo:
    tok = _load_hf(spec)
    if spec.kind == "bpe-pair":
        eod = tok.token_to_id(GPT2_EOD_TOKEN)
        return _HFInfo(tok, tok.get_vocab_size(with_added_tokens=False), eod, [], [])
    eod = tok.token_to_id(spec.eos_token) if spec.eos_token else None
    prefix, suffix = _hf_special_affixes(tok) if spec.add_special_tokens else ([], [])
    return _HFInfo(tok, tok.get_vocab_size(with_added_tokens=True), eod, prefix, suffix)


# --------------------------------------------------------------------------- Megatron-Core face


def load_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> Any:
    """Build a ``megatron.core.tokenizers`` tokenizer (``MegatronTokenizerBase`` subclass).

    It has ``.vocab_size``, ``.eod``, ``.tokenize(text)``, ``.detokenize(ids)`` and
    ``.unique_identifiers``; ``tokenize`` gives exactly the ids ``preprocess`` writes (before EOD).
    Raises :class:`TokenizerError` (a ``ValueError``) naming the path for missing or bad files.
    """
    spec = resolve_spec(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    from data_tools.megatron_tokenizer import DataToolsTokenizer

    return DataToolsTokenizer(spec)


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


class _SentencePieceEncoder(BatchEncoder):
    name = "sentencepiece"

    def __init__(self, spec: TokenizerSpec, workers: int) -> None:
        self.sp = _load_sentencepiece(spec)
        self.workers = workers
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten(self.sp.encode(as_text_list(texts), num_threads=self.workers))


class _HFEncoder(BatchEncoder):
    name = "tokenizers"

    def __init__(self, spec: TokenizerSpec, workers: int) -> None:
        info = _hf_info(spec)
        self.tok, self.vocab_size, self.eod = info.tok, info.vocab_size, info.eod
        self.prefix, self.suffix = info.prefix, info.suffix

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encs = self.tok.encode_batch_fast(as_text_list(texts), add_special_tokens=False)
        flat, offsets = _flatten([e.ids for e in encs])
        return _wrap(flat, offsets, self.prefix, self.suffix)


class _TiktokenEncoder(BatchEncoder):
    name = "tiktoken"

    def __init__(self, spec: TokenizerSpec, workers: int) -> None:
        self.lib = _load_tiktoken(spec)
        self.workers = workers
        self.vocab_size = self.lib.vocab_size if isinstance(self.lib.vocab_size, int) else self.lib._vocab_size
        self.eod = self.lib.eos_id

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        out = self.lib.tokenizer.encode_batch(as_text_list(texts), num_threads=self.workers, allowed_special="all")
        return _flatten(out)


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
