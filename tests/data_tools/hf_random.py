"""A randomly initialised transformers model written tensor by tensor (tests and benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from model_providers import family_for_hf
from model_providers.core.mapping import Duplicate
from pretrain.hf.writers import ShardedSafetensorsWriter, TensorEntry


def duplicates(hf_cfg) -> dict[str, str]:
    """HF tensors stored as copies of others (DeepSeek's MTP embedding and head): name → the original's name."""
    family = family_for_hf(hf_cfg)
    m = SimpleNamespace(**family.from_hf_config(hf_cfg))
    return {name: rule.same_as for rule in family.mapping_for(m) if isinstance(rule, Duplicate)
            for name in rule.hf_names(None)}


def write_random_hf(directory: str | Path, hf_cfg, *, seed: int = 0, std: float = 0.02,
                    max_shard_bytes: int = 5 * 10**9) -> int:
    """A randomly initialised transformers model written tensor by tensor (tests, benchmarks). Returns bytes."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(hf_cfg, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shapes = family_for_hf(hf_cfg).hf_shapes(hf_cfg)  # with the MTP layers transformers does not build
    copies = duplicates(hf_cfg)
    entries = sorted((TensorEntry(name, tuple(shape), dtype) for name, shape in shapes.items()),
                     key=lambda e: e.name in copies)  # the originals before their copies (a stable sort)
    writer = ShardedSafetensorsWriter(directory, entries, max_shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    drawn: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.name in copies:
            t = drawn[copies[e.name]]
        elif len(e.shape) == 1:  # norms around 1, biases around 0
            base = 1.0 if e.name.endswith("weight") else 0.0
            t = base + 0.1 * torch.randn(e.shape, generator=gen)
        else:
            t = std * torch.randn(e.shape, generator=gen)
        drawn[e.name] = t
        writer.write(e.name, t.to(dtype))
    writer.close()
    config = family_for_hf(hf_cfg).config_json(hf_cfg)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return sum(e.nbytes for e in entries)
