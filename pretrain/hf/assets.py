"""The files of a HuggingFace model that are not weights, carried through import, training and export.

`from-hf` copies the HF directory's `config.json`, tokenizer files and `generation_config.json` byte for byte
into `CKPT/hf_assets/`. `to-hf` finds them for a checkpoint — in its own directory, else in the checkpoint its
run started from (`checkpoint.pretrained` in run_config.yaml, followed back through runs that started from
runs) — and writes them out unchanged; `config.json` is kept as the original when the trained model's fields
still mean the same configuration (`Family.export_config_json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrain import safe_paths

ASSET_DIR = "hf_assets"
# Copied when present: the original config, the tokenizer (any of its formats) and the generation defaults.
ASSET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
               "chat_template.jinja", "chat_template.json")
ASSET_PATTERNS = ("*.tiktoken",)
TOKENIZER_FILES = tuple(f for f in ASSET_FILES if f not in ("config.json", "generation_config.json"))


def asset_names(hf_dir: Path) -> list[str]:
    """The asset files present in an HF model directory (each checked: inside it, or in its HF cache blobs)."""
    names = {f for f in ASSET_FILES if safe_paths.present(hf_dir, f) and not (hf_dir / f).is_dir()}
    for pattern in ASSET_PATTERNS:
        names.update(p.name for p in hf_dir.glob(pattern) if not p.is_dir())
    for name in names:
        safe_paths.inside(hf_dir, name, "an HF asset file")
    return sorted(names)


def copy_assets(hf_dir: Path, checkpoint_dir: Path) -> list[str]:
    """Copy the HF directory's assets into `checkpoint_dir/hf_assets` (byte for byte); the names copied."""
    names = asset_names(hf_dir)
    if names:
        target = checkpoint_dir / ASSET_DIR
        target.mkdir()
        for name in names:
            safe_paths.copy_file(hf_dir, name, target / name)
    return names


def find_assets(checkpoint: Path, max_hops: int = 16) -> Path | None:
    """The `hf_assets` directory of `checkpoint` or of the checkpoint its run started from (None: none)."""
    from pretrain.checkpoint.format import CheckpointError, read_saved_config, resolve_checkpoint

    path, seen = checkpoint, set()
    for _ in range(max_hops):
        if (path / ASSET_DIR).is_dir():
            return path / ASSET_DIR
        seen.add(path.resolve())
        try:
            pretrained = (read_saved_config(path).get("checkpoint") or {}).get("pretrained")
            if not pretrained:
                return None
            path = resolve_checkpoint(pretrained)
        except (CheckpointError, OSError, AttributeError):
            return None
        if path.resolve() in seen:
            return None
    return None


def original_config(assets: Path | None, model_type: str) -> dict | None:
    """The imported model's config.json, when there is one of this model type."""
    if assets is None or not safe_paths.present(assets, "config.json"):
        return None
    try:
        original = json.loads(safe_paths.read_bytes(assets, "config.json", "an imported HF file"))
    except ValueError:
        return None
    return original if isinstance(original, dict) and original.get("model_type") == model_type else None


def write_assets(assets: Path, output: Path, names: tuple[str, ...]) -> list[str]:
    """Copy the named asset files present in `assets` into `output`; the names copied."""
    copied = []
    for name in names:
        if safe_paths.present(assets, name):
            safe_paths.copy_file(assets, name, output / name)
            copied.append(name)
    for pattern in ASSET_PATTERNS:
        for p in sorted(assets.glob(pattern)):
            safe_paths.copy_file(assets, p.name, output / p.name)
            copied.append(p.name)
    return copied


def has_tokenizer_files(assets: Path | None) -> bool:
    """Whether an `hf_assets` (or HF model) directory holds any tokenizer file."""
    return assets is not None and (any(safe_paths.present(assets, f) for f in TOKENIZER_FILES)
                                   or any(True for _ in assets.glob(ASSET_PATTERNS[0])))
