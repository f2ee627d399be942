"""Count the bytes autograd holds for backward, to check the activation model against real ranks.

    meter = SavedTensorMeter(excluded=lambda: parameter_storages(chunks))
    meter.label_layers(chunks)            # optional: attribute bytes to each decoder layer
    with meter:                           # torch.autograd.graph.saved_tensors_hooks underneath
        ...forward and backward...
    meter.peak, meter.by_label

Every tensor autograd saves passes through the pack hook. A tensor is counted by its storage (views and
tensors sharing storage count once, for as long as any saved reference to it is alive); parameters'
storages are excluded (they are weights, not activations): those `excluded` returns, and the storage of
every `torch.nn.Parameter` saved (with DDP's contiguous buffer, all of them). `peak` is the largest number
of bytes alive at once; `by_label` the bytes first saved while each label (e.g. one decoder layer's forward) was active.
`held()` sizes the live storages now: storages freed in place after being saved (Megatron-Core's
`CheckpointWithoutOutput` empties recomputed norm outputs once the next GEMM has saved them) count 0.
Tensor subclasses that wrap other tensors (FP8 tensors) are counted through their inner tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch


def _storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(key, bytes) of the storages behind `t` (inner tensors of wrapper subclasses)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        out: list[tuple[int, int]] = []
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out += _storages(inner)
        return out
    try:
        st = t.untyped_storage()
        return [(st.data_ptr(), st.nbytes())] if st.nbytes() else []
    except (RuntimeError, NotImplementedError):
        return [(id(t), t.numel() * t.element_size())]


def parameter_storages(modules: Iterable[torch.nn.Module]) -> set[int]:
    """Storage keys of every parameter of `modules` (DDP's contiguous buffer when it holds them)."""
    return {key for m in modules for p in m.parameters() for key, _ in _storages(p)}


class _Saved:
    """What the pack hook returns: keeps the tensor, releases its storages' counts when autograd drops it."""

    __slots__ = ("tensor", "entries", "meter")

    def __init__(self, tensor: torch.Tensor, entries: list[list], meter: SavedTensorMeter):
        self.tensor, self.entries, self.meter = tensor, entries, meter

    def __del__(self):
        self.meter._release(self.entries)


class SavedTensorMeter:
    """Live and peak bytes of the distinct storages autograd has saved for backward."""

    def __init__(self, excluded: Callable[[], set[int]] | None = None):
        self._excluded_fn = excluded
        self._excluded: set[int] | None = None
        self._live: dict[int, list] = {}  # key -> [bytes, references, key, untyped storage of a plain tensor]
        self.current = 0
        self.peak = 0
        self.label: Any = None
        self.by_label: dict[Any, int] = defaultdict(int)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        if self._excluded is None:
            self._excluded = self._excluded_fn() if self._excluded_fn else set()
        if isinstance(t, torch.nn.Parameter):  # a weight (its storage may be DDP's whole buffer): never counted
            for key, _ in _storages(t):
                self._excluded.add(key)
                entry = self._live.pop(key, None)
                if entry is not None:
                    self.current -= entry[0]
                    entry[0] = 0
            return t
        entries = []
        for key, nbytes in _storages(t):
            if key in self._excluded:
                continue
            entry = self._live.get(key)
            if entry is not None and entry[3] is not None and entry[3].data_ptr() != key:
                # Freed in place since it was saved (resize_(0)); this address now belongs to another storage.
                del self._live[key]
                self.current -= entry[0]
                entry[0] = 0
                entry = None
            if entry is None:
                storage = t.untyped_storage() if type(t) is torch.Tensor else None
                entry = self._live[key] = [nbytes, 0, key, storage]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
                if self.label is not None:
                    self.by_label[self.label] += nbytes
            entry[1] += 1
            entries.append(entry)
        return _Saved(t, entries, self) if entries else t

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, entries: list[list]) -> None:
        for entry in entries:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                entry[0] = 0
                if self._live.get(entry[2]) is entry:
                    del self._live[entry[2]]

    def held(self) -> int:
        """Bytes of the saved storages alive now, at their current size."""
        return sum(e[3].nbytes() if e[3] is not None else e[0] for e in self._live.values())

    def label_layers(self, chunks: Iterable[torch.nn.Module], layer_type: type, first_calls: int = 1) -> None:
        """Attribute bytes to (chunk, layer) during the first `first_calls` forward calls of each layer."""
        for c, chunk in enumerate(chunks):
            for i, layer in enumerate(m for m in chunk.modules() if isinstance(m, layer_type)):
                calls = [0]

                def pre(_m, _args, key=(c, i), calls=calls):
                    calls[0] += 1
                    if calls[0] <= first_calls and torch.is_grad_enabled():
                        self.label = key

                def post(_m, _args, _out):
                    self.label = None

                layer.register_forward_pre_hook(pre)
                layer.register_forward_hook(post)
