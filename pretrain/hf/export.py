"""Export: a torch_dist checkpoint saved at any TP/PP/VP layout → a transformers model directory.

to-hf recovers the model config from the checkpoint's run_config.yaml (storage keys are layout-independent
global names). Each parameter is read one layer slice at a time, regrouped by the family's HF mapping rules and
appended to safetensors shards whose headers are planned up front.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from model_providers import get_family
from model_providers.core.family import dims
from model_providers.core.mapping import ConversionError, Dims, Index, MappingRule
from pretrain import safe_paths
from pretrain.hf.files import DTYPES, Progress, commit_dir, discard_dir, peak_rss_bytes, staging_dir
from pretrain.hf.readers import CheckpointReader, load_run_config
from pretrain.hf.tokenizer import hf_tokenizer
from pretrain.hf.writers import ShardedSafetensorsWriter, TensorEntry


@dataclasses.dataclass
class _Unit:
    """One read: a Megatron tensor (or layer slice) and the HF tensors the rule makes of it."""

    rule: MappingRule
    layer: Index
    entries: list[TensorEntry]


def _meta_to_hf(rule: MappingRule, shape: tuple[int, ...], d: Dims, what: str) -> list[torch.Tensor]:
    try:
        return rule.to_hf(torch.empty(shape, device="meta"), d)
    except (RuntimeError, ConversionError) as exc:
        raise ConversionError(f"{what}: shape {list(shape)} does not fit rule '{rule.op}' ({exc})") from None


def plan_export(family: str, tensors: dict, d: Dims, num_layers: int, expected: dict[str, tuple],
                dtype: torch.dtype, rules: tuple[MappingRule, ...] | None = None) -> list[_Unit]:
    """Which reads produce which HF tensors; every name and shape checked against the HF model.

    `rules`: the model's mapping (`Family.mapping_for`); default the family's table."""
    units: list[_Unit] = []
    used: set[str] = set()
    produced: set[str] = set()
    for rule in rules if rules is not None else get_family(family).mapping:
        keys = rule.storage_keys()  # several for a tensor stored in parts (`MappingRule.parts`: Mamba, Gated DeltaNet)
        stored = [tensors.get(k) for k in keys]
        if stored[0] is None:
            continue
        if None in stored:
            raise ConversionError(f"checkpoint tensor '{keys[stored.index(None)]}' is missing (with '{keys[0]}')")
        md = stored[0]
        used.update(keys)
        shape = tuple(md.size)
        if len(stored) > 1:
            shape = tuple(rule.join([torch.empty(tuple(x.size), device="meta") for x in stored]).shape)
        layers = rule.indices(num_layers, d.num_experts)
        if rule.stack_dims:
            stack = rule.stack_shape(num_layers, d.num_experts)
            if not rule.per_layer and shape[0] != num_layers:
                raise ConversionError(f"checkpoint tensor '{rule.megatron}' stacks {shape[0]} layers, "
                                      f"model.num_layers is {num_layers}")
            if shape[:len(stack)] != stack:
                raise ConversionError(f"checkpoint tensor '{rule.megatron}' stacks {shape[len(stack) - 1]} experts, "
                                      f"model.num_moe_experts is {d.num_experts}")
            shape = shape[rule.stack_dims:]
        for layer in layers:
            outs = _meta_to_hf(rule, shape, d, f"checkpoint tensor '{rule.megatron}'")
            entries = []
            for name, out in zip(rule.hf_names(layer), outs):
                if name not in expected:
                    raise ConversionError(f"checkpoint tensor '{rule.megatron}' maps to '{name}', which the "
                                          f"transformers model does not have")
                if tuple(out.shape) != tuple(expected[name]):
                    raise ConversionError(f"checkpoint tensor '{rule.megatron}' gives '{name}' of shape "
                                          f"{list(out.shape)}; the transformers model expects {list(expected[name])}")
                entries.append(TensorEntry(name, tuple(out.shape), md.properties.dtype if rule.keeps_dtype else dtype))
                produced.add(name)
            units.append(_Unit(rule, layer, entries))
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ConversionError(f"checkpoint tensor '{unknown[0]}' is not in the {family} HF mapping"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    missing = sorted(set(expected) - produced)
    if missing:
        raise ConversionError(f"HF tensor '{missing[0]}' has no source tensor in the checkpoint"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return units


def _without_custom_code(config: dict | None, architecture: str) -> tuple[dict | None, list[str]]:
    """`config` without `auto_map` and with `architectures` naming only ours; the keys changed."""
    if config is None:
        return None, []
    out, dropped = dict(config), []
    if "auto_map" in out:
        del out["auto_map"]
        dropped.append("auto_map (custom code)")
    if out.get("architectures") not in (None, [architecture]):
        dropped.append(f"architectures={out['architectures']!r}")
        out["architectures"] = [architecture]
    return out, dropped


def _without_quantization(config: dict | None, dtype: torch.dtype) -> tuple[dict | None, dict]:
    """`config` without `quantization_config` (the import dequantized those weights: `pretrain.hf.mxfp4`), and the
    safetensors index metadata saying so (empty: the imported model was not quantized)."""
    if config is None or "quantization_config" not in config:
        return config, {}
    quant = config["quantization_config"]
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    written = str(dtype).removeprefix("torch.")
    print(f"[convert] note: the imported model stored weights as {method}; this export writes every weight "
          f"unquantized ({written}) and its config.json has no quantization_config (recorded in "
          "model.safetensors.index.json)", file=sys.stderr)
    return {k: v for k, v in config.items() if k != "quantization_config"}, {
        "dequantized_from": str(method), "dtype": written}


def _export_tokenizer(d, assets: Path | None, given: str | None, original: dict | None):
    """(transformers tokenizer or None, the imported tokenizer files' directory or None, original config); `d`: the
    run's data section.

    `--tokenizer` wins; else the imported HF model's tokenizer files; else, for a model imported without a
    tokenizer whose runs named none since, no tokenizer (weights and config only, with a note); else the run's.
    """
    from pretrain.hf.assets import has_tokenizer_files
    from pretrain.hf.import_checks import TOKENIZER_FIELDS, read_import_record

    if given is None and has_tokenizer_files(assets):
        return hf_tokenizer(d, str(assets)), assets, original
    record = read_import_record(assets)
    if given is None and record is not None and record.get("no_tokenizer") and \
            {k: getattr(d, k) for k in TOKENIZER_FIELDS} == record.get("data_tokenizer_fields"):
        print(f"[convert] note: the model was imported from {record.get('source')} without tokenizer files and no "
              "run named one since: exporting weights and config.json only (pass --tokenizer to add one)",
              file=sys.stderr)
        return None, None, original
    try:
        tok = hf_tokenizer(d, given)
    except ConversionError as exc:
        if given is not None or record is None or not record.get("no_tokenizer"):
            raise
        # Imported without a tokenizer, trained with one transformers has no equivalent of (e.g. the null
        # tokenizer of mock data): the export is what the import was, weights and config.
        print(f"[convert] note: the model was imported from {record.get('source')} without tokenizer files and the "
              f"run's tokenizer cannot be written for transformers ({exc}): exporting weights and config.json only "
              "(pass --tokenizer to add one)", file=sys.stderr)
        return None, None, original
    if original is not None and given is not None:  # the tokenizer given decides the token ids
        original = {k: v for k, v in original.items() if k not in ("bos_token_id", "eos_token_id")}
    return tok, None, original


def export_to_hf(checkpoint: str | Path, output: str | Path, *, iteration: int | None = None,
                 dtype: str | None = None, tokenizer: str | None = None, overwrite: bool = False,
                 max_shard_bytes: int = 5 * 10**9, progress: bool = True) -> dict:
    """Convert a torch_dist checkpoint (any layout) to a transformers model directory. Returns a summary."""
    from transformers import GenerationConfig

    from pretrain.checkpoint.format import resolve_checkpoint
    from pretrain.hf.assets import TOKENIZER_FILES, find_assets, original_config, write_assets
    from pretrain.run_plan import resolve_tokenizer

    started = time.perf_counter()
    output = Path(output)
    ckpt = resolve_checkpoint(checkpoint, iteration)
    cfg = load_run_config(ckpt)
    m = cfg.model
    reader = CheckpointReader(ckpt)
    if "embedding.word_embeddings.weight" not in reader.tensors:
        raise ConversionError(f"{ckpt}: no 'embedding.word_embeddings.weight' (checkpoint without model weights?)")
    stored_dtype = reader.tensors["embedding.word_embeddings.weight"].properties.dtype
    out_dtype = DTYPES[dtype] if dtype else stored_dtype
    family = get_family(m.family)
    # The imported HF model's files (config.json, tokenizer, generation config), when the run started from one.
    assets = find_assets(ckpt)
    raw_original = original_config(assets, family.hf_model_type)
    original, dropped = _without_custom_code(raw_original, family.hf_architecture)
    if dropped:
        print(f"[convert] note: the imported config.json's {' and '.join(dropped)} are not exported (an exported "
              f"model runs as the built-in {family.hf_architecture}, never custom code)", file=sys.stderr)
    original, unquantized = _without_quantization(original, out_dtype)
    tok, tokenizer_files, original = _export_tokenizer(cfg.data, assets, tokenizer, original)
    vocab = m.vocab_size
    if vocab is None:  # the run's tokenizer, as the run plan decides it (`pretrain.run_plan`)
        planned = resolve_tokenizer(cfg)
        vocab = planned.vocab_size
        if vocab is None:  # the run's tokenizer files may be gone; the HF one then decides
            if tokenizer is None or tok is None:
                raise ConversionError(f"cannot load the run's tokenizer ({planned.error}); pass --tokenizer")
            vocab = len(tok)
    rows = reader.tensors["embedding.word_embeddings.weight"].size[0]
    if rows < vocab:
        raise ConversionError(f"checkpoint tensor 'embedding.word_embeddings.weight' has {rows} rows, fewer than "
                              f"the vocabulary ({vocab})")
    if tok is not None and len(tok) > vocab:
        raise ConversionError(f"tokenizer has {len(tok)} tokens but the model's vocabulary is {vocab}: pass "
                              "--tokenizer with the model's own tokenizer")
    d = dims(m, vocab, rows)
    bos, eos = (tok.bos_token_id, tok.eos_token_id) if tok is not None else (None, None)
    hf_cfg = family.to_hf_config(m, vocab, bos=bos, eos=eos, dtype=out_dtype, base=original)
    config_json, departs = family.export_config_json(hf_cfg, original)
    config_json, _ = _without_custom_code(config_json, family.hf_architecture)
    if departs:
        print(f"[convert] note: config.json differs from the imported model's in {', '.join(departs)} (the trained "
              "model's fields)", file=sys.stderr)
    expected = family.hf_shapes(hf_cfg)
    units = plan_export(m.family, reader.tensors, d, m.num_layers, expected, out_dtype, family.mapping_for(m))
    entries = [e for u in units for e in u.entries]

    staging = staging_dir(output, overwrite, ckpt)
    try:
        writer = ShardedSafetensorsWriter(staging, entries, max_shard_bytes, unquantized)
        bar = Progress(len(entries), sum(e.nbytes for e in entries), "to-hf", progress)
        for unit in units:
            source = unit.rule.join([reader.read(key, unit.layer) for key in unit.rule.storage_keys()])
            outs = unit.rule.to_hf(source, d)
            for entry, tensor in zip(unit.entries, outs):
                writer.write(entry.name, tensor.to(entry.dtype))
                bar.update(entry.nbytes)
            del source, outs
        writer.close()
        if raw_original is not None and config_json == raw_original:  # same dtype too: the original file itself
            safe_paths.copy_file(assets, "config.json", staging / "config.json")
        elif original is not None and not departs:
            (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        else:
            (staging / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        if tokenizer_files is not None:  # the imported model's files, unchanged
            write_assets(tokenizer_files, staging, TOKENIZER_FILES + ("generation_config.json",))
        elif tok is not None:
            tok.save_pretrained(str(staging))
        elif assets is not None:  # imported without a tokenizer: weights and config, as the HF directory was
            write_assets(assets, staging, ("generation_config.json",))
        if tok is not None and not (staging / "generation_config.json").exists():
            GenerationConfig(bos_token_id=hf_cfg.bos_token_id, eos_token_id=hf_cfg.eos_token_id).save_pretrained(
                staging)
        commit_dir(staging, output)
    except BaseException as exc:
        discard_dir(staging, output, exc)
        raise
    elapsed = time.perf_counter() - started
    return {"output": str(output), "checkpoint": str(ckpt), "tensors": len(entries), "bytes": bar.bytes,
            "shards": len(writer.shards), "seconds": elapsed, "peak_rss_bytes": peak_rss_bytes(),
            "vocab_size": vocab, "padded_vocab_size": rows,
            "config_json": "original" if original is not None and not departs else "generated",
            "hf_assets": str(assets) if assets is not None else None, "unquantized": unquantized or None}
