"""Import: a transformers safetensors model → a torch_dist checkpoint the trainer loads at any layout.

One HF tensor is read at a time; the checkpoint is written with torch.distributed.checkpoint's FileSystemWriter
and a planner that produces each layer slice only when the writer asks for it, into a staging directory renamed
into place when complete. The HF model's other files are carried along in `CKPT/hf_assets`.
"""

from __future__ import annotations

import io
import time
import warnings
from pathlib import Path

import torch

from model_providers import family_for_hf, get_family
from model_providers.core import hybrid
from model_providers.core.family import dims
from model_providers.core.mapping import ConversionError, Duplicate, MappingRule
from pretrain.hf import mxfp4
from pretrain.hf.assets import ASSET_DIR, copy_assets
from pretrain.hf.files import (
    DTYPES,
    SAFETENSORS_DTYPES,
    Progress,
    commit_dir,
    discard_dir,
    lead_offsets,
    peak_rss_bytes,
    staging_dir,
)
from pretrain.hf.import_checks import (
    TOKENIZER_FIELDS,
    check_run_config,
    check_tied_head,
    config_notes,
    one_line,
    read_hf_config,
    tokenizer_fields,
    write_import_record,
)
from pretrain.hf.readers import HFReader
from pretrain.hf.writers import StreamingSavePlanner, writer_class

# Megatron linear modules (`...linear_*.weight` in the mapping, MTP's `eh_proj`, the in- and output projections of
# Gated DeltaNet and Mamba) carry an (empty) `_extra_state` that the trainer's sharded state dict expects.
_LINEAR_WEIGHT = (".linear_", ".eh_proj.", ".in_proj.", ".out_proj.")


def check_duplicate(rule: Duplicate, reader: HFReader) -> None:
    """An HF tensor stored as a copy of another (MTP's embedding and head) must equal it: Megatron ties them."""
    for name in rule.hf_names(None):
        if not torch.equal(reader.read(name), reader.read(rule.same_as)):
            raise ConversionError(f"HF tensor '{name}' differs from '{rule.same_as}'; the trainer ties them (one "
                                  "embedding and output head shared with the MTP layers)")


def _hf_names_in(rule: MappingRule, layer: int | None, hf_info: dict) -> list[str] | None:
    names = rule.hf_names(layer)
    present = [n in hf_info for n in names]
    if not any(present):
        return None
    if not all(present):
        missing = names[present.index(False)]
        raise ConversionError(f"HF tensor '{missing}' is missing (needed with {names[present.index(True)]})")
    return names


_SHAPE_FIELDS = ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "normalization", "gated_linear_unit", "activation", "position_embedding_type",
                 "share_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                 "rotary_base", "rope_scaling", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
                 "moe_router_pre_softmax")


def _run_config_for(hf_cfg, fields: dict, config: str | None, hf_dir: Path, overrides: list[str],
                    assets: Path | None = None):
    """The run config to store beside the imported weights (the --config file with the HF model's shape).

    `assets`: where the HF model's tokenizer files will be (the checkpoint's hf_assets); without --config they
    become the data tokenizer.
    """
    from pretrain.config import config_from_dict, load_config
    from pretrain.validate import length_problems

    base = load_config(config, overrides)
    tree = base.to_dict()
    model = dict(tree["model"])
    if config:
        norm = {**model, "num_query_groups": model["num_query_groups"] or model["num_attention_heads"],
                "kv_channels": model["kv_channels"]}
        want = {**fields, "num_query_groups": fields["num_query_groups"] or fields["num_attention_heads"]}
        for key in _SHAPE_FIELDS:
            if key in want and norm.get(key) != want[key]:
                if key == "kv_channels" and (norm.get(key) or model["hidden_size"] // model["num_attention_heads"]) \
                        == (want[key] or want["hidden_size"] // want["num_attention_heads"]):
                    continue
                raise ConversionError(f"{config}: model.{key}={norm.get(key)!r} but the HF model has {want[key]!r}")
        fields = {**fields, "seq_length": model["seq_length"]}  # the training length is the config's
    else:
        tok = tokenizer_fields(hf_dir, assets if assets is not None else hf_dir.resolve())
        if tok is not None:
            tree["data"].update(tok)
        if any(o.split("=", 1)[0].strip() == "model.seq_length" for o in overrides):  # a training setting
            fields = {**fields, "seq_length": model["seq_length"]}
    tree["model"] = {**model, **fields, "preset": None}
    cfg = config_from_dict(tree)
    problems = length_problems(cfg.model)  # e.g. a learned position table shorter than the training length
    if problems:
        raise ConversionError(str(problems[0]))
    return cfg


def import_from_hf(hf_dir: str | Path, output: str | Path, *, config: str | None = None, dtype: str | None = None,
                   overrides: list[str] | tuple[str, ...] = (), overwrite: bool = False, progress: bool = True) -> dict:
    """Convert a transformers safetensors model to a torch_dist checkpoint our trainer loads at any layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from pretrain.checkpoint.torch_dist import write_checkpoint_files
    started = time.perf_counter()
    hf_dir, output = Path(hf_dir), Path(output)
    config_json = hf_dir / "config.json"
    hf_cfg, tree = read_hf_config(hf_dir)
    hf_family = family_for_hf(hf_cfg)
    notes = config_notes(tree, hf_family, config_json)
    hf_cfg, note = hf_family.config_for_weights(hf_cfg, lambda: set(HFReader(hf_dir).info))  # e.g. no MTP weights
    notes += [note] if note else []
    try:
        fields = hf_family.from_hf_config(hf_cfg)
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as exc:
        if isinstance(exc, ConversionError):
            raise
        raise ConversionError(f"{config_json}: cannot read the model's sizes ({one_line(exc)})") from None
    assets_dir = output.resolve() / ASSET_DIR
    tokenizer = "config" if config else ("hf" if tokenizer_fields(hf_dir, assets_dir) else "none")
    cfg = _run_config_for(hf_cfg, fields, config, hf_dir, list(overrides), assets_dir)
    layout = check_run_config(cfg, config_json, tokenizer=tokenizer, hf_dir=hf_dir)  # before any tensor is read
    m = cfg.model
    vocab = fields["vocab_size"]
    padded = layout.padded_vocab  # of model.vocab_size = the HF vocabulary, at the config's TP
    family = get_family(m.family)
    d = dims(m, vocab, padded)
    reader, dequantized = mxfp4.dequantizing(HFReader(hf_dir), tree, DTYPES[dtype] if dtype else None)
    notes += [mxfp4.note(dequantized)] if dequantized else []
    check_tied_head(reader, family, m.share_embeddings_and_output_weights, config_json)
    expected = family.hf_shapes(hf_cfg)
    rules = family.mapping_for(m)
    ignored = family.ignored_patterns()
    for name, (shape, st_dtype) in reader.info.items():
        if name in expected:
            if not st_dtype.is_floating_point:
                raise ConversionError(
                    f"{hf_dir / reader.weight_map[name]}: tensor '{name}' is {SAFETENSORS_DTYPES[st_dtype]} "
                    "(not floating point); refusing to cast model weights from an integer type")
            if tuple(shape) != tuple(expected[name]):
                raise ConversionError(f"HF tensor '{name}' has shape {list(shape)}; config.json implies "
                                      f"{list(expected[name])}")
        elif not (any(p.fullmatch(name) for p in ignored)
                  or (name == "lm_head.weight" and m.share_embeddings_and_output_weights)):
            raise ConversionError(f"HF tensor '{name}' is not in the {m.family} HF mapping")
    for name in expected:
        if name not in reader.info:
            raise ConversionError(f"HF tensor '{name}' is missing from {hf_dir}")

    # Plan: one write item per layer slice (and per non-stacked tensor), plus the linears' empty extra state.
    items, sources = [], {}
    for rule in rules:
        layers = rule.indices(m.num_layers, d.num_experts)
        names0 = _hf_names_in(rule, layers[0], reader.info)
        if names0 is None:
            continue
        if rule.megatron == "output_layer.weight" and m.share_embeddings_and_output_weights:
            continue
        if isinstance(rule, Duplicate):  # a stored copy of another HF tensor: checked, not written
            check_duplicate(rule, reader)
            continue
        metas = [torch.empty(reader.info[n][0], device="meta") for n in names0]
        try:
            slice_shape = tuple(rule.from_hf(metas, d).shape)
        except (RuntimeError, ConversionError) as exc:
            raise ConversionError(f"HF tensor '{names0[0]}': {exc}") from None
        tdtype = DTYPES[dtype] if dtype and not rule.keeps_dtype else reader.info[names0[0]][1]
        stack = rule.stack_shape(m.num_layers, d.num_experts)
        props = TensorProperties(dtype=tdtype)
        pieces = [tuple(p.shape) for p in rule.split(torch.empty(slice_shape, device="meta"))]
        for layer in layers:
            names = _hf_names_in(rule, layer, reader.info)
            if names is None:
                raise ConversionError(f"HF tensor '{rule.hf_names(layer)[0]}' is missing")
            for part, (key, piece) in enumerate(zip(rule.storage_keys(), pieces)):  # one key, or its parts
                offsets = (*lead_offsets(layer), *[0] * len(piece))
                sizes = (*[1] * rule.stack_dims, *piece)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                                   size=torch.Size((*stack, *piece)))))
                sources[(key, tuple(offsets))] = (rule, names, sizes, tdtype, part)
    extra = io.BytesIO()
    torch.save([None], extra)
    for rule in rules:
        if not any(w in rule.megatron for w in _LINEAR_WEIGHT) or not rule.megatron.endswith(".weight") or (
                not rule.stack_dims and not rule.per_layer) or isinstance(rule, Duplicate):
            continue
        stack, slices = rule.storage_slices(m.num_layers, d.num_experts)
        stack = stack or (1,)  # an unstacked per-layer key: shard 0 of 1
        for layer in slices:
            shard = f"shard_{'.'.join(map(str, lead_offsets(layer) or (0,)))}_{'.'.join(map(str, stack))}"
            key = f"{rule.megatron.removesuffix('.weight')}._extra_state/{shard}"
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
    if hybrid.is_hybrid(m):  # Megatron-Core's MambaModel keeps its output layer's extra state (GPTModel drops it)
        items.append(WriteItem(index=MetadataIndex("output_layer._extra_state/shard_0_1"), type=WriteItemType.BYTE_IO))
    total_bytes = sum(int(torch.Size(s[2]).numel()) * torch.empty((), dtype=s[3]).element_size()
                      for s in sources.values())
    bar = Progress(len(sources), total_bytes, "from-hf", progress)

    last: dict = {}  # the whole tensor of the parts being written (a rule stored in parts reads its HF tensors once)

    def resolve(item):
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(extra.getvalue())
        rule, names, sizes, tdtype, part = sources[(item.index.fqn, tuple(item.index.offset))]
        if last.get("names") != names:  # a tensor stored in parts: its HF tensors read once for all its parts
            last.update(names=names, pieces=rule.split(rule.from_hf([reader.read(n) for n in names], d)))
        tensor = last["pieces"][part]
        tensor = tensor.to(tdtype).reshape(sizes).contiguous()
        bar.update(tensor.nbytes)
        return tensor

    staging = staging_dir(output, overwrite, hf_dir)
    try:
        writer = writer_class()(str(staging), single_file_per_rank=True, thread_count=1, sync_files=True)
        writer.final_id = str(output.resolve())
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=writer, planner=StreamingSavePlanner(items, resolve), no_dist=True)
        common = {"iteration": 0, "consumed_samples": 0, "layout": [0, 0, 0, 0, 0], "config": cfg.to_dict()}
        write_checkpoint_files(staging, common, cfg.to_yaml())
        assets = copy_assets(hf_dir, staging)
        no_tokenizer = {k: getattr(cfg.data, k) for k in TOKENIZER_FIELDS} if tokenizer == "none" else None
        write_import_record(staging, hf_dir, no_tokenizer, dequantized)
        commit_dir(staging, output)
    except BaseException as exc:
        discard_dir(staging, output, exc)
        raise
    return {"output": str(output), "tensors": len(sources), "bytes": bar.bytes,
            "seconds": time.perf_counter() - started, "peak_rss_bytes": peak_rss_bytes(), "vocab_size": vocab,
            "padded_vocab_size": padded, "family": m.family, "hf_assets": assets, "notes": notes,
            "tokenizer": tokenizer, "dequantized": dequantized}
