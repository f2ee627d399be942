"""What an input file really is, and its decompressed bytes with every early end or corruption refused.

- :func:`check_format`: the file's first bytes (magic numbers) against what its name says. A ``.jsonl`` that is
  gzip, zstd, bzip2, xz, zip, Parquet or Arrow data (or a ``.jsonl.gz`` that is plain text) is refused with
  one line saying what the file really is and what to do, instead of thousands of "invalid UTF-8" lines.
- :func:`open_decompressed`: a reader of the decompressed stream. gzip raises on a cut or corrupt member itself
  (``EOFError``, ``BadGzipFile``); zstd is read frame by frame with ``decompressobj``, so a stream that ends
  inside a frame (a partial download: ``stream_reader`` returns the first half silently) is refused too. Every
  failure is an :class:`InputError` naming the file and the compressed byte offset.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Any, BinaryIO


class InputError(ValueError):
    """Unusable input: the message names the file (and line, row group or offset, where there is one)."""


JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd")
PARQUET_SUFFIXES = (".parquet",)

# (magic, format, description, what to do when the name says otherwise)
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x1f\x8b", "gzip", "gzip-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd-compressed data"),
    (b"PAR1", "parquet", "a Parquet file"),
    (b"BZh", "bzip2", "bzip2-compressed data"),
    (b"\xfd7zXZ\x00", "xz", "xz-compressed data"),
    (b"PK\x03\x04", "zip", "a zip archive"),
    (b"7z\xbc\xaf\x27\x1c", "7z", "a 7-Zip archive"),
    (b"ARROW1", "arrow", "an Arrow IPC file"),
    (b"\xff\xff\xff\xff", "arrow", "an Arrow IPC stream (e.g. a datasets .arrow shard)"),
    (b"\xff\xfe", "utf16", "UTF-16 text"),
    (b"\xfe\xff", "utf16", "UTF-16 text"),
)
_RENAME = {"gzip": ".jsonl.gz", "zstd": ".jsonl.zst", "parquet": ".parquet", "text": ".jsonl"}
_UNREAD = {"bzip2": "decompress it first (bunzip2) or recompress it as .jsonl.zst",
           "xz": "decompress it first (unxz) or recompress it as .jsonl.zst",
           "zip": "extract it first", "7z": "extract it first",
           "arrow": "write it as Parquet (pyarrow.parquet.write_table) or JSONL",
           "utf16": "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"}
_ZSTD_FEED = 8 << 10  # compressed bytes per decompressobj call: bounds the output of one call (RLE blocks)


def named_format(path: Path) -> str:
    """The format a file's name says: gzip, zstd, parquet or text (JSON lines)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return "gzip"
    if name.endswith((".zst", ".zstd")):
        return "zstd"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def sniff(head: bytes) -> tuple[str, str]:
    """(format, description) of a file starting with ``head``; ("text", ...) when no magic matches."""
    for magic, fmt, what in _MAGIC:
        if head.startswith(magic):
            return fmt, what
    if len(head) >= 4 and 0x50 <= head[0] <= 0x5F and head[1:4] == b"\x2a\x4d\x18":  # a skippable frame (pzstd)
        return "zstd", "zstd-compressed data"
    return "text", "plain text"


def check_format(path: Path) -> str:
    """The file's format; raises :class:`InputError` when its content is not what its name says."""
    with open(path, "rb") as f:
        head = f.read(8)
    named = named_format(path)
    if not head:
        if named in ("gzip", "zstd", "parquet"):
            raise InputError(f"{path}: empty file, expected {named} data (a failed download?)")
        return named
    real, what = sniff(head)
    if real == named:
        return named
    if real in _UNREAD:
        raise InputError(f"{path}: is {what}, which preprocess does not read: {_UNREAD[real]}")
    if named == "text":
        raise InputError(f"{path}: is {what}, not JSON lines: rename it with the suffix {_RENAME[real]}")
    expected = {"gzip": "gzip-compressed data", "zstd": "zstd-compressed data", "parquet": "a Parquet file"}[named]
    hint = f"rename it with the suffix {_RENAME[real]}" if real in _RENAME else "check how it was made"
    raise InputError(f"{path}: is {what}, not {expected} as its name says: {hint}")


class _ZstdFrames(io.RawIOBase):
    """Decompressed zstd, frame after frame; ends only at the end of a frame (else :class:`InputError`)."""

    def __init__(self, raw: BinaryIO, path: Path) -> None:
        import zstandard

        self.raw, self.path, self.zstd = raw, path, zstandard
        self.dctx = zstandard.ZstdDecompressor()
        self.frame: Any = None  # the decompressobj of the frame being read (None: between frames)
        self.pending = b""  # compressed bytes read but not yet fed
        self.out = bytearray()
        self.done = False

    def readable(self) -> bool:
        return True

    def _fill(self, n: int) -> None:
        while len(self.out) < n and not self.done:
            data = self.pending or self.raw.read(_ZSTD_FEED)
            self.pending = b""
            if not data:
                if self.frame is not None:
                    raise InputError(f"{self.path}: ends inside a zstd frame at compressed byte {self.raw.tell():,} "
                                     "(truncated: a partial download?)")
                self.done = True
                return
            if self.frame is None:
                self.frame = self.dctx.decompressobj()
            try:
                self.out += self.frame.decompress(data)
            except self.zstd.ZstdError as e:
                raise InputError(f"{self.path}: corrupt zstd data near compressed byte {self.raw.tell():,} ({e})") \
                    from None
            if self.frame.eof:
                self.pending, self.frame = self.frame.unused_data, None

    def read(self, n: int = -1) -> bytes:
        self._fill(n if n >= 0 else 1 << 62)
        take = len(self.out) if n < 0 else min(n, len(self.out))
        got = bytes(self.out[:take])
        del self.out[:take]
        return got

    def readinto(self, b: Any) -> int:
        got = self.read(len(b))
        b[: len(got)] = got
        return len(got)


class Decompressed:
    """The decompressed bytes of one input file; ``read`` raises :class:`InputError` naming the file and offset."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path, self.fmt = path, fmt
        self.raw = open(path, "rb")
        if fmt == "gzip":
            import gzip

            self.stream: Any = gzip.GzipFile(fileobj=self.raw, mode="rb")
        elif fmt == "zstd":
            self.stream = _ZstdFrames(self.raw, path)
        else:
            self.stream = self.raw
        self.seekable = fmt == "text"

    def read(self, n: int, after_line: int = 0) -> bytes:
        try:
            return self.stream.read(n)
        except InputError:
            raise
        except (OSError, EOFError, ValueError, zlib.error) as e:  # gzip: EOFError (cut), BadGzipFile, zlib.error
            after = f", after line {after_line:,}" if after_line else ""
            raise InputError(f"{self.path}: truncated or corrupt {self.fmt} data near compressed byte "
                             f"{self.raw.tell():,}{after} ({e})") from e

    def seek(self, pos: int) -> None:
        self.stream.seek(pos)

    def disk_pos(self) -> int:
        return self.raw.tell()

    def close(self) -> None:
        self.stream.close()
        self.raw.close()
