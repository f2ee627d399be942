"""What both directions of the HF bridge share: dtypes, progress and memory reports, and staged output
directories that appear only when complete."""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from model_providers.core.mapping import ConversionError, Index

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """One status line on stderr: tensors done, tensors/s and GB/s."""

    def __init__(self, total: int, total_bytes: int, label: str, enabled: bool = True):
        self.total, self.total_bytes, self.label, self.enabled = total, total_bytes, label, enabled
        self.done = self.bytes = 0
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.last > (0.2 if self.tty else 5.0) or self.done == self.total):
            self.last = now
            end = "\n" if (self.done == self.total or not self.tty) else ""
            print(f"\r{self.line()}", end=end, file=sys.stderr, flush=True)

    def line(self) -> str:
        el = max(time.perf_counter() - self.start, 1e-9)
        return (f"[convert] {self.label} {self.done}/{self.total} tensors {self.bytes / 1e9:.2f}/"
                f"{self.total_bytes / 1e9:.2f} GB | {self.done / el:.1f} tensors/s | {self.bytes / 1e9 / el:.3f} GB/s")


def staging_dir(output: Path, overwrite: bool, source: Path) -> Path:
    """A fresh staging directory beside `output` (refusing a non-empty `output` without overwrite)."""
    out, src = output.resolve(), source.resolve()
    if out == src or out in src.parents:
        raise ConversionError(f"{output}: the output would replace the input {source}; choose another directory")
    if output.exists():
        if not output.is_dir():
            raise ConversionError(f"{output}: exists and is not a directory")
        if any(output.iterdir()) and not overwrite:
            raise ConversionError(f"{output}: directory is not empty (pass --overwrite to replace it)")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    return staging


def commit_dir(staging: Path, output: Path) -> None:
    """Move the complete staging directory into place (replacing `output`)."""
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        os.replace(output, old)
    os.replace(staging, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard_dir(staging: Path, output: Path, exc: BaseException) -> None:
    """Remove the staging directory of a failed conversion; a full or read-only file system is reported as
    one line naming the output (judged before the removal frees the space)."""
    from pretrain.run.run_dir import write_failure

    why = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else write_failure(exc, staging)
    shutil.rmtree(staging, ignore_errors=True)
    if why is not None:
        raise ConversionError(f"{output}: writing failed: {why}; nothing was written there") from exc


def lead_offsets(index: Index) -> tuple[int, ...]:
    """The leading-dim offsets of a slice index: () unstacked, (layer,), or (layer, expert)."""
    if index is None:
        return ()
    return tuple(index) if isinstance(index, tuple) else (index,)
