"""Tensors Megatron-Core stores in parts, between the two checkpoint formats.

torch_dist holds such a tensor (Gated DeltaNet's `in_proj`: query, key, value, z, beta, alpha; its `conv1d`: query,
key, value) as one checkpoint tensor per part, `KEY.<part>`, each split over tensor parallelism on its own (the
module's `sharded_state_dict` builds them with a factory). Megatron-FSDP's fsdp_dtensor keeps the module's tensor
whole: the TP ranks' local tensors one after another along dim 0, each [its share of part 0; of part 1; ...]. A
`Parts` (in the fsdp_dtensor checkpoint's `names` map, `fsdp_format.stored_names`) records the parts' global row
counts and the TP size, from which rows of one layout are found in the other.
"""

from __future__ import annotations

from typing import TypedDict


class Parts(TypedDict):
    """The parts of one tensor: [[name, global rows], ...] in stored order, and the tensor-parallel size."""

    parts: list[list]
    tp: int


def is_parts(half) -> bool:
    """Whether a `names` entry's third field describes parts (else None, "w" or "v": the SwiGLU halves)."""
    return isinstance(half, dict)


def torch_dist_keys(entry: list) -> list[str]:
    """The torch_dist keys a `names` entry ([key, lead, half]) stands for: its key, or its parts' `KEY.<part>`."""
    key, _, half = entry
    return [f"{key}.{name}" for name, _ in half["parts"]] if is_parts(half) else [key]


def _shares(spec: Parts) -> tuple[list[int], int]:
    """(each part's rows on one TP rank, the local tensor's rows)."""
    shares = [rows // spec["tp"] for _, rows in spec["parts"]]
    return shares, sum(shares)


def whole_to_parts(spec: Parts, lo: int, hi: int) -> list[tuple[str, int, int]]:
    """Rows lo..hi-1 of the whole (fsdp_dtensor) tensor as (part name, first part row, end part row) runs, in
    order."""
    shares, local = _shares(spec)
    runs = []
    for rank in range(spec["tp"]):
        start = rank * local
        for (name, _), share in zip(spec["parts"], shares):
            a, b = max(lo, start), min(hi, start + share)
            if a < b:
                runs.append((name, rank * share + a - start, rank * share + b - start))
            start += share
    return runs


def part_to_whole(spec: Parts, name: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """Rows lo..hi-1 of part `name` (its torch_dist tensor) as (first, end) row runs of the whole tensor, in
    order."""
    shares, local = _shares(spec)
    index = [n for n, _ in spec["parts"]].index(name)
    share, before = shares[index], sum(shares[:index])
    runs = []
    for rank in range(spec["tp"]):
        a, b = max(lo, rank * share), min(hi, (rank + 1) * share)
        if a < b:
            base = rank * local + before - rank * share
            runs.append((base + a, base + b))
    return runs
