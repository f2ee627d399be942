"""What `from-hf` checks before it writes anything, so it never writes a checkpoint its own `validate` refuses.

- `read_hf_config`: `config.json` read through `pretrain.safe_paths` (never a symlink out of the directory) and
  parsed by transformers from a private copy; a config transformers rejects is one line. `auto_map` (custom code)
  is never run and never exported; it and a foreign `architectures` entry are noted.
- `tokenizer_fields`: the data tokenizer the HF directory's own files make (tokenizer.json, tokenizer.model,
  vocab.json + merges.txt), or None: a directory without tokenizer files imports without one (recorded in
  `CKPT/hf_import.json`, so `to-hf` exports weights and config only, as the directory was).
- `check_run_config`: the pre-flight validation of the run config written (sizes, heads, experts against
  `parallel.*`, at the smallest world size the layout allows), and the tokenizer against the vocabulary.
- `check_tied_head`: a tied model whose file also holds a *different* `lm_head.weight` is refused (the weight
  would be dropped); an identical copy is dropped silently, as transformers does.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from model_providers.core.mapping import ConversionError
from pretrain import safe_paths
from pretrain.hf.assets import ASSET_DIR

TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
IMPORT_RECORD = "hf_import.json"  # beside CKPT/hf_assets: what the import had (never exported)
_VERSIONS_KEY = "run.allow_untested_versions"  # the version matrix is the trainer's business, not the import's


def one_line(exc: BaseException) -> str:
    """An exception's message as one line (transformers' validators wrap the reason in a header line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[0].endswith(":"):
        return re.sub(r"^\w+(Error|Exception): ", "", lines[-1])
    return lines[0]


def read_hf_config(hf_dir: Path) -> tuple[Any, dict]:
    """(transformers config, config.json as a dict) of an HF model directory; ConversionError in one line."""
    from transformers import CONFIG_MAPPING, AutoConfig
    from transformers.utils import logging as hf_logging

    path = hf_dir / "config.json"
    if not safe_paths.present(hf_dir, "config.json"):
        raise ConversionError(f"{hf_dir}: no config.json (not a transformers model directory)")
    raw = safe_paths.read_bytes(hf_dir, "config.json", "the model's config")
    try:
        tree = json.loads(raw)
    except ValueError as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(tree, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(tree).__name__}")
    model_type = tree.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        from model_providers import FAMILIES

        custom = " (defined by custom code: auto_map, which is never run)" if tree.get("auto_map") else ""
        known = ", ".join(sorted(f.hf_model_type for f in FAMILIES.values()))
        raise ConversionError(f"{path}: model_type {model_type!r}{custom} is not supported ({known})")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings about odd values: our validation names them in one line
    tmp = tempfile.mkdtemp(prefix="from-hf-config-")
    try:  # transformers reads this copy, and nothing else of hf_dir
        (Path(tmp) / "config.json").write_bytes(raw)
        hf_cfg = AutoConfig.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise many types
        raise ConversionError(f"{path}: {one_line(exc).replace(tmp, str(hf_dir))}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        shutil.rmtree(tmp, ignore_errors=True)
    return hf_cfg, tree


def config_notes(tree: dict, family: Any, path: Path) -> list[str]:
    """Notes for what the import does not take from config.json: custom code, a foreign architecture name."""
    notes = []
    if tree.get("auto_map"):
        names = ", ".join(sorted(tree["auto_map"])) if isinstance(tree["auto_map"], dict) else "custom code"
        notes.append(f"{path}: auto_map ({names}) names custom code; it is not run: the weights are read as the "
                     f"built-in {family.hf_architecture}, and exported config.json files carry no auto_map")
    archs = tree.get("architectures")
    if archs and archs != [family.hf_architecture]:
        notes.append(f"{path}: architectures={archs!r}; imported (and exported) as {family.hf_architecture}")
    return notes


def tokenizer_fields(hf_dir: Path, assets: Path) -> dict | None:
    """The `data.*` tokenizer fields for the HF directory's tokenizer (its files will be in `assets`), or None."""
    def has(name: str) -> bool:
        return safe_paths.present(hf_dir, name)

    if has("tokenizer.json"):
        return {"tokenizer_type": "huggingface", "tokenizer_model": str(assets), "vocab_file": None,
                "merge_file": None}
    if has("tokenizer.model"):
        return {"tokenizer_type": "sentencepiece", "tokenizer_model": str(assets / "tokenizer.model"),
                "vocab_file": None, "merge_file": None}
    if has("vocab.json") and has("merges.txt"):
        return {"tokenizer_type": "GPT2BPETokenizer", "tokenizer_model": None,
                "vocab_file": str(assets / "vocab.json"), "merge_file": str(assets / "merges.txt")}
    return None


def _min_world(p) -> int:
    """The smallest world size the parallel section `p` allows (TP×PP×CP and expert TP×EP×PP both divide it)."""
    from pretrain.layout import expert_tensor_size

    dense = max(1, p.tensor * p.pipeline * p.context)
    experts = max(1, expert_tensor_size(p) * p.expert * p.pipeline)
    return math.lcm(dense, experts)


def check_run_config(cfg, config_json: Path, *, tokenizer: str, hf_dir: Path):
    """Refuse (one line naming the first problem) a run config the trainer's validation would refuse; else return the
    layout validation derived (`pretrain.layout.Layout`: the padded vocabulary).

    `tokenizer`: "hf" (the data tokenizer is the HF directory's: its files are checked where they are now, the
    config naming the paths they will have in the checkpoint), "config" (the --config's, checked as it is) or
    "none" (the import has no tokenizer: the config names none of the model's, and the note says to give one).
    """
    import dataclasses

    from pretrain.data.check import check_tokenizer
    from pretrain.data.plan import uses_mock
    from pretrain.problems import Report
    from pretrain.tokenizer.choice import decide
    from pretrain.validate import check

    world = _min_world(cfg.parallel)
    report, layout = check(cfg, world, files=False)
    errors = [p for p in report.errors if _VERSIONS_KEY not in p.keys]
    if tokenizer != "none" and not errors:
        check = cfg
        if tokenizer == "hf":
            check = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **_relocated(cfg.data, hf_dir)))
        tok_report = Report(world)
        d = check.data
        check_tokenizer(decide(d, check.model.vocab_size, uses_mock(d), check.model.preset), d, check.model, tok_report)
        errors += tok_report.errors
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConversionError(f"{config_json}: the run config it makes does not validate (world size {world}): "
                              f"{errors[0]}{more}")
    return layout


def _relocated(data, hf_dir: Path) -> dict:
    """The data tokenizer fields with the checkpoint's hf_assets paths replaced by the HF directory's files."""
    out = {}
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(data, key)
        if value and Path(value).parent.name == ASSET_DIR:
            out[key] = str(safe_paths.inside(hf_dir, Path(value).name, "the model's tokenizer"))
        elif value and Path(value).name == ASSET_DIR:
            out[key] = str(hf_dir.resolve())
    return out


def check_tied_head(reader, family, tied: bool, config_json: Path) -> None:
    """A tied model's file holding an `lm_head.weight` unlike its embedding is refused (it would be dropped)."""
    import torch

    names = {r.megatron: r.hf_names(None)[0] for r in family.mapping
             if r.megatron in ("embedding.word_embeddings.weight", "output_layer.weight")}
    head, embed = names.get("output_layer.weight"), names.get("embedding.word_embeddings.weight")
    if not tied or head not in reader.info or embed not in reader.info:
        return
    a, b = reader.read(head), reader.read(embed)
    if a.shape != b.shape or not torch.equal(a, b):
        diff = f"{(a.float() - b.float()).abs().max().item():.4g}" if a.shape == b.shape else f"shape {list(a.shape)}"
        raise ConversionError(f"{config_json}: tie_word_embeddings=true but the weights hold a '{head}' that differs "
                              f"from '{embed}' (max abs diff {diff}); importing would drop it. Set "
                              "tie_word_embeddings=false in config.json to import both, or remove the tensor")


def write_import_record(staging: Path, hf_dir: Path, no_tokenizer_fields: dict | None,
                        dequantized: dict | None = None) -> None:
    """`CKPT/hf_import.json` (beside `hf_assets/`, which holds the HF files only): the source; for an import
    that named no tokenizer (no tokenizer files, no --config), the data fields written, so `to-hf` can tell
    whether a later run named one; for quantized weights, what was dequantized (`pretrain.hf.mxfp4`)."""
    record = {"source": str(hf_dir.resolve()), "no_tokenizer": no_tokenizer_fields is not None,
              "data_tokenizer_fields": no_tokenizer_fields}
    if dequantized is not None:
        record["dequantized"] = dequantized
    (staging / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def read_import_record(assets: Path | None) -> dict | None:
    """The import record of the checkpoint whose `hf_assets` directory is `assets` (None: none)."""
    if assets is None or not safe_paths.present(assets.parent, IMPORT_RECORD):
        return None
    try:
        record = json.loads(safe_paths.read_bytes(assets.parent, IMPORT_RECORD))
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
