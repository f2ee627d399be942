"""The reader and encoder threads of ``preprocess`` and the bounded queues between them (at most two batches
each, so memory does not grow with the input)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data_tools.inputs import read_batches
from data_tools.tokenizers import BatchEncoder


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class Stages:
    """The reader and encoder threads and the bounded queues between them and the writing thread."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.read_q: queue.Queue = queue.Queue(maxsize=2)
        self.enc_q: queue.Queue = queue.Queue(maxsize=2)
        self.threads: list[threading.Thread] = []

    def put(self, q: queue.Queue, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def get(self, q: queue.Queue) -> Any:
        while not self.stop.is_set():
            try:
                return q.get(timeout=0.2)
            except queue.Empty:
                continue
        return None

    def _start(self, target: Any, name: str) -> None:
        self.threads.append(threading.Thread(target=target, name=name, daemon=True))
        self.threads[-1].start()

    def start_reader(self, files: list[Path], keys: list[str], batch_bytes: int, start: tuple, on_bad: Any) -> None:
        def read_stage() -> None:
            try:
                for b in read_batches(files, keys, batch_bytes, start, on_bad):
                    if not self.put(self.read_q, b):
                        return
                self.put(self.read_q, None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self.put(self.read_q, e)

        self._start(read_stage, "data_tools-reader")

    def start_encoder(self, enc: BatchEncoder, keys: list[str], memory_budget_bytes: int,
                      on_reset: Callable[[], None]) -> None:
        rss_base = rss_bytes()

        def encode_stage() -> None:
            try:
                while True:
                    item = self.get(self.read_q)
                    if item is None or isinstance(item, BaseException):
                        self.put(self.enc_q, item)
                        return
                    encoded = {}
                    for k in keys:
                        texts = item.texts[k]
                        encoded[k] = enc.encode(texts) if len(texts) else (np.zeros(0, np.int64), np.zeros(1, np.int64))
                    if not self.put(self.enc_q, (item, encoded)):
                        return
                    if hasattr(enc, "reset") and rss_bytes() - rss_base > memory_budget_bytes:
                        # gigatoken's pretoken caches grow with the vocabulary seen (hash tables
                        # that double, so the budget leaves room for one doubling under 1 GiB).
                        enc.reset()
                        on_reset()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self.put(self.enc_q, e)

        self._start(encode_stage, "data_tools-encoder")

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
