"""HuggingFace bridge: Megatron `torch_dist` checkpoints ↔ transformers safetensors, streaming.

    python -m data_tools convert to-hf --checkpoint RUN_DIR_or_CKPT_DIR [--iteration N] --output HF_DIR
        [--dtype bf16|fp16|fp32] [--tokenizer PATH] [--overwrite] [--max-shard-gb G]
    python -m data_tools convert from-hf --hf HF_DIR --output CKPT_DIR [--config CONFIG] [--dtype ...]

to-hf recovers the model config from the checkpoint's run_config.yaml, so a checkpoint saved at any
TP/PP/VP layout converts the same way: storage keys are layout-independent global names. Each
parameter is read one layer slice at a time through torch.distributed.checkpoint's FileSystemReader
(tensor payloads with `torch.load(weights_only=True)`, the `.metadata` index through the trainer's
allow-list unpickler),
regrouped by the family's HF_MAPPING rules and appended to safetensors shards written by a streaming
writer whose headers are planned up front. from-hf reads one HF tensor at a time with safetensors and
writes the checkpoint with torch.distributed.checkpoint's FileSystemWriter and a planner that produces
each layer slice only when the writer asks for it. Output goes to a staging directory that is renamed
into place only when complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from data_tools.hf_assets import ASSET_DIR, copy_assets
from model_providers import family_for_hf, get_family
from model_providers.core.family import dims, hf_parameter_shapes
from model_providers.core.mapping import ConversionError, Dims, Index, MappingRule

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Optimizer state keys; MoE models chain a dense and an expert optimizer (`chained_<i>.optimizer...`).
_OPTIMIZER_STATE = re.compile(r"(chained_\d+\.)?optimizer\.")
# Megatron linear modules (`...linear_*.weight` in the mapping) carry an (empty) `_extra_state` that the
# trainer's sharded state dict expects.
_LINEAR_WEIGHT = ".linear_"


# --------------------------------------------------------------------------------------------------
# Progress, memory, output directories
# --------------------------------------------------------------------------------------------------


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


def _staging(output: Path, overwrite: bool, source: Path) -> Path:
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


def _commit(staging: Path, output: Path) -> None:
    """Move the complete staging directory into place (replacing `output`)."""
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        os.replace(output, old)
    os.replace(staging, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _discard(staging: Path, output: Path, exc: BaseException) -> None:
    """Remove the staging directory of a failed conversion; a full or read-only file system is reported as
    one line naming the output (judged before the removal frees the space)."""
    from pretrain.run_dir import write_failure

    why = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else write_failure(exc, staging)
    shutil.rmtree(staging, ignore_errors=True)
    if why is not None:
        raise ConversionError(f"{output}: writing failed: {why}; nothing was written there") from exc


# --------------------------------------------------------------------------------------------------
# Reading torch_dist checkpoints
# --------------------------------------------------------------------------------------------------


class CheckpointReader:
    """Reads single tensors (or one layer slice of a stacked tensor) from a torch_dist checkpoint."""

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from pretrain.checkpoint.format import inspect_checkpoint

        self.path = path
        _, self.metadata = inspect_checkpoint(path)  # format, allow-listed index, files present and long enough
        self.reader = FileSystemReader(str(path))
        self.reader.set_up_storage_reader(self.metadata, True)
        self.tensors = {
            k: v for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and not _OPTIMIZER_STATE.match(k) and "_extra_state" not in k
        }

    def read(self, key: str, layer: Index = None) -> torch.Tensor:
        """The whole tensor `key`, or its slice `layer` along dim 0 (a (layer, expert) tuple: dims 0 and 1)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.tensors[key]
        size = list(md.size)
        offsets = [0] * len(size)
        lead = _lead(layer)
        for dim, i in enumerate(lead):
            offsets[dim], size[dim] = i, 1
        dest = torch.empty(size, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(size))
        items = create_read_items_for_chunk_list(key, md, [chunk])
        covered = sum(torch.Size(i.lengths).numel() for i in items)
        if covered != dest.numel():
            raise ConversionError(f"{self.path}: tensor '{key}' is incomplete in the checkpoint "
                                  f"({covered} of {dest.numel()} elements stored)")
        self.reader.read_data(LoadPlan(items), _IntoTensor(dest)).wait()
        return dest.reshape(dest.shape[len(lead):])


def _lead(index: Index) -> tuple[int, ...]:
    """The leading-dim offsets of a slice index: () unstacked, (layer,), or (layer, expert)."""
    if index is None:
        return ()
    return tuple(index) if isinstance(index, tuple) else (index,)


class _IntoTensor:
    """Minimal load planner for FileSystemReader.read_data: every read lands in one tensor."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest

    def resolve_tensor(self, req) -> torch.Tensor:
        t = self.dest
        for dim, (off, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(dim, off, length)
        return t

    def commit_tensor(self, req, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req, value) -> None:
        raise ConversionError(f"unexpected byte item {req.storage_index.fqn}")


def load_run_config(ckpt: Path):
    """The `Config` the checkpoint was saved with (run_config.yaml beside it)."""
    from pretrain.checkpoint.format import read_saved_config
    from pretrain.config import config_from_dict

    return config_from_dict(read_saved_config(ckpt))


# --------------------------------------------------------------------------------------------------
# Streaming safetensors writer
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class ShardedSafetensorsWriter:
    """Writes tensors, in a fixed planned order, into `model-0000i-of-0000n.safetensors` shards.

    Headers are computed from the plan before any data arrives, so each tensor is written as soon as
    it is produced and then dropped. `close()` writes model.safetensors.index.json.
    """

    def __init__(self, directory: Path, entries: list[_Entry], max_shard_bytes: int):
        self.dir, self.entries = directory, entries
        shards: list[list[_Entry]] = [[]]
        size = 0
        for e in entries:
            if shards[-1] and size + e.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        n = len(shards)
        self.shards = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", s) for i, s in enumerate(shards)]
        self.order = [e.name for e in entries]
        self.position = 0
        self.shard_index = -1
        self.file = None
        self.remaining: list[str] = []

    def _open_next(self) -> None:
        if self.file is not None:
            self.file.close()
        self.shard_index += 1
        fname, entries = self.shards[self.shard_index]
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for e in entries:
            header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.file = open(self.dir / fname, "wb")
        self.file.write(len(blob).to_bytes(8, "little"))
        self.file.write(blob)
        self.remaining = [e.name for e in entries]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries[self.position]
        if name != entry.name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ConversionError(f"internal: tensor '{name}' {tuple(tensor.shape)} {tensor.dtype} does not match "
                                  f"the plan ('{entry.name}' {entry.shape} {entry.dtype})")
        if not self.remaining:
            self._open_next()
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data))
        self.remaining.pop(0)
        self.position += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.position != len(self.entries):
            raise ConversionError(f"internal: {len(self.entries) - self.position} planned tensors were not written")
        total = sum(e.nbytes for e in self.entries)
        weight_map = {e.name: fname for fname, entries in self.shards for e in entries}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def hf_tokenizer(data_cfg, override: str | None = None):
    """A transformers tokenizer equal to the run's tokenizer (or the one at `override`)."""
    from transformers import AutoTokenizer, GPT2Tokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    from data_tools.assets import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

    def from_sentencepiece(model: Path):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(model, Path(tmp) / "tokenizer.model")
            return LlamaTokenizer.from_pretrained(tmp)

    def from_path(p: Path):
        if p.is_dir():
            return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        if p.suffix == ".model":
            return from_sentencepiece(p)
        if p.suffix == ".json":
            return PreTrainedTokenizerFast(tokenizer_file=str(p))
        raise ConversionError(f"--tokenizer {p}: expected a tokenizer directory, tokenizer.json or tokenizer.model")

    if override is not None:
        p = Path(override)
        if not p.exists():
            raise ConversionError(f"--tokenizer {p}: no such file or directory")
        return from_path(p)
    ttype = data_cfg.tokenizer_type.lower()
    if ttype in ("sentencepiece", "gptsentencepiecetokenizer", "sentencepiecetokenizer"):
        return from_sentencepiece(Path(data_cfg.tokenizer_model or MISTRAL_TOKENIZER))
    if ttype == "gpt2bpetokenizer" or (ttype in ("huggingface", "huggingfacetokenizer") and data_cfg.vocab_file):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(data_cfg.vocab_file or GPT2_VOCAB, Path(tmp) / "vocab.json")
            shutil.copy(data_cfg.merge_file or GPT2_MERGES, Path(tmp) / "merges.txt")
            return GPT2Tokenizer.from_pretrained(tmp)
    if ttype in ("huggingface", "huggingfacetokenizer") and data_cfg.tokenizer_model:
        return from_path(Path(data_cfg.tokenizer_model))
    raise ConversionError(f"tokenizer type '{data_cfg.tokenizer_type}' has no transformers equivalent here; "
                          "pass --tokenizer HF_TOKENIZER_DIR")


# --------------------------------------------------------------------------------------------------
# Export: torch_dist → HF
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Unit:
    """One read: a Megatron tensor (or layer slice) and the HF tensors the rule makes of it."""

    rule: MappingRule
    layer: Index
    entries: list[_Entry]


def _meta_to_hf(rule: MappingRule, shape: tuple[int, ...], d: Dims, what: str) -> list[torch.Tensor]:
    try:
        return rule.to_hf(torch.empty(shape, device="meta"), d)
    except (RuntimeError, ConversionError) as exc:
        raise ConversionError(f"{what}: shape {list(shape)} does not fit rule '{rule.op}' ({exc})") from None


def plan_export(family: str, tensors: dict, d: Dims, num_layers: int, expected: dict[str, tuple],
                dtype: torch.dtype) -> list[_Unit]:
    """Which reads produce which HF tensors; every name and shape checked against the HF model."""
    units: list[_Unit] = []
    used: set[str] = set()
    produced: set[str] = set()
    for rule in get_family(family).mapping:
        md = tensors.get(rule.megatron)
        if md is None:
            continue
        used.add(rule.megatron)
        shape = tuple(md.size)
        layers = rule.indices(num_layers, d.num_experts)
        if rule.stack_dims:
            if shape[0] != num_layers:
                raise ConversionError(f"checkpoint tensor '{rule.megatron}' stacks {shape[0]} layers, "
                                      f"model.num_layers is {num_layers}")
            if rule.stack_dims == 2 and shape[1] != d.num_experts:
                raise ConversionError(f"checkpoint tensor '{rule.megatron}' stacks {shape[1]} experts, "
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
                entries.append(_Entry(name, tuple(out.shape), dtype))
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


def export_to_hf(checkpoint: str | Path, output: str | Path, *, iteration: int | None = None,
                 dtype: str | None = None, tokenizer: str | None = None, overwrite: bool = False,
                 max_shard_bytes: int = 5 * 10**9, progress: bool = True) -> dict:
    """Convert a torch_dist checkpoint (any layout) to a transformers model directory. Returns a summary."""
    from transformers import GenerationConfig

    from data_tools.hf_assets import TOKENIZER_FILES, find_assets, original_config, write_assets
    from pretrain.checkpoint.format import resolve_checkpoint
    from pretrain.data import build_tokenizer

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
    original = original_config(assets, family.hf_model_type)
    if tokenizer is None and assets is not None and any((assets / f).is_file() for f in TOKENIZER_FILES):
        tokenizer_files = assets
        tok = hf_tokenizer(cfg.data, str(assets))
    else:
        tokenizer_files = None
        tok = hf_tokenizer(cfg.data, tokenizer)
        if original is not None and tokenizer is not None:  # the tokenizer given decides the token ids
            original = {k: v for k, v in original.items() if k not in ("bos_token_id", "eos_token_id")}
    vocab = m.vocab_size
    if vocab is None:
        try:
            vocab = build_tokenizer(cfg.data).vocab_size
        except Exception as exc:  # the run's tokenizer files may be gone; the HF one then decides
            if tokenizer is None:
                raise ConversionError(f"cannot load the run's tokenizer ({exc}); pass --tokenizer") from None
            vocab = len(tok)
    rows = reader.tensors["embedding.word_embeddings.weight"].size[0]
    if rows < vocab:
        raise ConversionError(f"checkpoint tensor 'embedding.word_embeddings.weight' has {rows} rows, fewer than "
                              f"the vocabulary ({vocab})")
    if len(tok) > vocab:
        raise ConversionError(f"tokenizer has {len(tok)} tokens but the model's vocabulary is {vocab}")
    d = dims(m, vocab, rows)
    hf_cfg = family.to_hf_config(m, vocab, bos=tok.bos_token_id, eos=tok.eos_token_id, dtype=out_dtype, base=original)
    config_json, departs = family.export_config_json(hf_cfg, original)
    if departs:
        print(f"[convert] note: config.json differs from the imported model's in {', '.join(departs)} (the trained "
              "model's fields)", file=sys.stderr)
    expected = hf_parameter_shapes(hf_cfg)
    units = plan_export(m.family, reader.tensors, d, m.num_layers, expected, out_dtype)
    entries = [e for u in units for e in u.entries]

    staging = _staging(output, overwrite, ckpt)
    try:
        writer = ShardedSafetensorsWriter(staging, entries, max_shard_bytes)
        bar = Progress(len(entries), sum(e.nbytes for e in entries), "to-hf", progress)
        for unit in units:
            source = reader.read(unit.rule.megatron, unit.layer)
            outs = unit.rule.to_hf(source, d)
            for entry, tensor in zip(unit.entries, outs):
                writer.write(entry.name, tensor.to(out_dtype))
                bar.update(entry.nbytes)
            del source, outs
        writer.close()
        if original is not None and config_json == original:  # same dtype too: the original file itself
            shutil.copyfile(assets / "config.json", staging / "config.json")
        elif original is not None and not departs:
            (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        else:
            (staging / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        if tokenizer_files is not None:  # the imported model's files, unchanged
            write_assets(tokenizer_files, staging, TOKENIZER_FILES + ("generation_config.json",))
        else:
            tok.save_pretrained(str(staging))
        if not (staging / "generation_config.json").exists():
            GenerationConfig(bos_token_id=hf_cfg.bos_token_id, eos_token_id=hf_cfg.eos_token_id).save_pretrained(
                staging)
        _commit(staging, output)
    except BaseException as exc:
        _discard(staging, output, exc)
        raise
    elapsed = time.perf_counter() - started
    return {"output": str(output), "checkpoint": str(ckpt), "tensors": len(entries), "bytes": bar.bytes,
            "shards": len(writer.shards), "seconds": elapsed, "peak_rss_bytes": peak_rss_bytes(),
            "vocab_size": vocab, "padded_vocab_size": rows,
            "config_json": "original" if original is not None and not departs else "generated",
            "hf_assets": str(assets) if assets is not None else None}


# --------------------------------------------------------------------------------------------------
# Import: HF → torch_dist
# --------------------------------------------------------------------------------------------------


class HFReader:
    """Reads single tensors from a safetensors model directory (opening the file per read: no lingering mmap)."""

    def __init__(self, directory: Path):
        self.dir = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in directory.glob("*.bin"))
                hint = f" (found {bins[0]}; only safetensors are read: pickled .bin files can run code)" if bins else ""
                raise ConversionError(f"{directory}: no *.safetensors weights{hint}")
            weight_map = {}
            for f in files:
                with _open_safetensors(f) as st:
                    weight_map.update({k: f.name for k in st.keys()})
        self.weight_map: dict[str, str] = weight_map
        self.info: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for fname in sorted(set(weight_map.values())):
            path = directory / fname
            if not path.exists():
                raise ConversionError(f"{path}: listed in the index but missing")
            with _open_safetensors(path) as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    self.info[k] = (tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), k))

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.dir / self.weight_map[name]), "pt") as st:
            return st.get_tensor(name)


def _open_safetensors(path: Path):
    """`safe_open`, with a truncated or foreign file reported as one line naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConversionError(f"{path}: not a readable safetensors file, truncated or corrupt ({reason})") from None


def _st_dtype(code: str, name: str) -> torch.dtype:
    for dt, c in SAFETENSORS_DTYPES.items():
        if c == code:
            return dt
    raise ConversionError(f"HF tensor '{name}': unsupported safetensors dtype {code}")


class _StreamingSavePlanner:
    """A torch.distributed.checkpoint SavePlanner over planned write items whose data is made on demand."""

    def __init__(self, items: list, resolve: Callable):
        self.items, self.resolve = items, resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import SavePlan

        return SavePlan(self.items)

    def create_global_plan(self, all_plans):
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan):
        return new_plan

    def resolve_data(self, write_item):
        return self.resolve(write_item)


def _writer_class():
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Writer(FileSystemWriter):
        """FileSystemWriter recording the final directory (a str: no pathlib objects in the index)."""

        final_id = ""

        def storage_meta(self) -> StorageMeta:
            return StorageMeta(checkpoint_id=self.final_id, save_id=self.save_id)

    return Writer


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
        tokenizer_dir = assets if assets is not None else hf_dir.resolve()
        if (hf_dir / "tokenizer.json").exists():
            tree["data"].update(tokenizer_type="huggingface", tokenizer_model=str(tokenizer_dir),
                                vocab_file=None, merge_file=None)
        elif (hf_dir / "tokenizer.model").exists():
            tree["data"].update(tokenizer_type="sentencepiece", tokenizer_model=str(tokenizer_dir / "tokenizer.model"))
        if any(o.split("=", 1)[0].strip() == "model.seq_length" for o in overrides):  # a training setting
            fields = {**fields, "seq_length": model["seq_length"]}
    tree["model"] = {**model, **fields, "preset": None}
    cfg = config_from_dict(tree)
    problems = length_problems(cfg.model)  # e.g. a sliding window shorter than the training length
    if problems:
        raise ConversionError(str(problems[0]))
    return cfg


def import_from_hf(hf_dir: str | Path, output: str | Path, *, config: str | None = None, dtype: str | None = None,
                   overrides: list[str] | tuple[str, ...] = (), overwrite: bool = False, progress: bool = True) -> dict:
    """Convert a transformers safetensors model to a torch_dist checkpoint our trainer loads at any layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from transformers import AutoConfig

    from pretrain.checkpoint.format import write_checkpoint_files
    from pretrain.layout import padded_vocab_size

    started = time.perf_counter()
    hf_dir, output = Path(hf_dir), Path(output)
    if not (hf_dir / "config.json").exists():
        raise ConversionError(f"{hf_dir}: no config.json (not a transformers model directory)")
    try:
        hf_cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ConversionError(f"{hf_dir / 'config.json'}: {exc}") from None
    fields = family_for_hf(hf_cfg).from_hf_config(hf_cfg)
    cfg = _run_config_for(hf_cfg, fields, config, hf_dir, list(overrides), output.resolve() / ASSET_DIR)
    m = cfg.model
    vocab = fields["vocab_size"]
    padded = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, cfg.parallel.tensor)
    family = get_family(m.family)
    d = dims(m, vocab, padded)
    reader = HFReader(hf_dir)
    expected = hf_parameter_shapes(hf_cfg)
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
    for rule in family.mapping:
        layers = rule.indices(m.num_layers, d.num_experts)
        names0 = _hf_names_in(rule, layers[0], reader.info)
        if names0 is None:
            continue
        if rule.megatron == "output_layer.weight" and m.share_embeddings_and_output_weights:
            continue
        metas = [torch.empty(reader.info[n][0], device="meta") for n in names0]
        try:
            slice_shape = tuple(rule.from_hf(metas, d).shape)
        except (RuntimeError, ConversionError) as exc:
            raise ConversionError(f"HF tensor '{names0[0]}': {exc}") from None
        tdtype = DTYPES[dtype] if dtype else reader.info[names0[0]][1]
        stack = (m.num_layers, d.num_experts)[:rule.stack_dims]
        global_shape = (*stack, *slice_shape)
        props = TensorProperties(dtype=tdtype)
        for layer in layers:
            names = _hf_names_in(rule, layer, reader.info)
            if names is None:
                raise ConversionError(f"HF tensor '{rule.hf_names(layer)[0]}' is missing")
            offsets = (*_lead(layer), *[0] * len(slice_shape))
            sizes = (*[1] * rule.stack_dims, *slice_shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            index = MetadataIndex(rule.megatron, torch.Size(offsets))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                               size=torch.Size(global_shape))))
            sources[(rule.megatron, tuple(offsets))] = (rule, names, sizes, tdtype)
    extra = io.BytesIO()
    torch.save([None], extra)
    for rule in family.mapping:
        if _LINEAR_WEIGHT not in rule.megatron or not rule.megatron.endswith(".weight") or not rule.stack_dims:
            continue
        stack = (m.num_layers, d.num_experts)[:rule.stack_dims]
        for layer in rule.indices(m.num_layers, d.num_experts):
            shard = f"shard_{'.'.join(map(str, _lead(layer)))}_{'.'.join(map(str, stack))}"
            key = f"{rule.megatron.removesuffix('.weight')}._extra_state/{shard}"
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
    total_bytes = sum(int(torch.Size(s[2]).numel()) * torch.empty((), dtype=s[3]).element_size()
                      for s in sources.values())
    bar = Progress(len(sources), total_bytes, "from-hf", progress)

    def resolve(item):
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(extra.getvalue())
        rule, names, sizes, tdtype = sources[(item.index.fqn, tuple(item.index.offset))]
        tensor = rule.from_hf([reader.read(n) for n in names], d).to(tdtype).reshape(sizes).contiguous()
        bar.update(tensor.nbytes)
        return tensor

    staging = _staging(output, overwrite, hf_dir)
    try:
        writer = _writer_class()(str(staging), single_file_per_rank=True, thread_count=1, sync_files=True)
        writer.final_id = str(output.resolve())
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, resolve), no_dist=True)
        common = {"iteration": 0, "consumed_samples": 0, "layout": [0, 0, 0, 0, 0], "config": cfg.to_dict()}
        write_checkpoint_files(staging, common, cfg.to_yaml())
        assets = copy_assets(hf_dir, staging)
        _commit(staging, output)
    except BaseException as exc:
        _discard(staging, output, exc)
        raise
    return {"output": str(output), "tensors": len(sources), "bytes": bar.bytes,
            "seconds": time.perf_counter() - started, "peak_rss_bytes": peak_rss_bytes(), "vocab_size": vocab,
            "padded_vocab_size": padded, "family": m.family, "hf_assets": assets}


def write_random_hf(directory: str | Path, hf_cfg, *, seed: int = 0, std: float = 0.02,
                    max_shard_bytes: int = 5 * 10**9) -> int:
    """A randomly initialised transformers model written tensor by tensor (tests, benchmarks). Returns bytes."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(hf_cfg, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shapes = hf_parameter_shapes(hf_cfg)
    entries = [_Entry(name, tuple(shape), dtype) for name, shape in shapes.items()]
    writer = ShardedSafetensorsWriter(directory, entries, max_shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    for e in entries:
        if len(e.shape) == 1:  # norms around 1, biases around 0
            base = 1.0 if e.name.endswith("weight") else 0.0
            t = base + 0.1 * torch.randn(e.shape, generator=gen)
        else:
            t = std * torch.randn(e.shape, generator=gen)
        writer.write(e.name, t.to(dtype))
    writer.close()
    config = family_for_hf(hf_cfg).config_json(hf_cfg)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return sum(e.nbytes for e in entries)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools convert",
                                     description="Megatron torch_dist checkpoints <-> HuggingFace transformers.")
    sub = parser.add_subparsers(dest="direction", required=True)
    p = sub.add_parser("to-hf", help="export a torch_dist checkpoint (any TP/PP/VP layout) to transformers")
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoints dir or iter_NNNNNNN dir")
    p.add_argument("--iteration", type=int, help="iteration to export (default: the latest)")
    p.add_argument("--output", required=True, help="HF model directory to create")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: as stored)")
    p.add_argument("--tokenizer", help="HF tokenizer dir / tokenizer.json / tokenizer.model (default: the imported "
                                       "HF model's files, else the run's tokenizer)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (default 5 GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("from-hf", help="import transformers safetensors weights as a torch_dist checkpoint")
    p.add_argument("--hf", required=True, help="transformers model directory (config.json + *.safetensors)")
    p.add_argument("--output", required=True, help="checkpoint directory to create (use as checkpoint.pretrained)")
    p.add_argument("--config", help="the training config to check the shape against (its parallel.tensor sets "
                                    "the vocabulary padding)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="stored dtype (default: as in the HF files)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of --config "
                                                                       "(e.g. parallel.tensor=2)")
    return parser


def _report(summary: dict, what: str) -> None:
    gb = summary["bytes"] / 1e9
    print(f"[convert] {what}: {summary['tensors']} tensors, {gb:.3f} GB in {summary['seconds']:.1f} s "
          f"({gb / max(summary['seconds'], 1e-9):.3f} GB/s), peak RSS {summary['peak_rss_bytes'] / 2**20:.0f} MiB "
          f"-> {summary['output']}", flush=True)


def main(argv: list[str]) -> int:
    """`python -m data_tools convert ...`; returns the exit status."""
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        if args.direction == "to-hf":
            summary = export_to_hf(args.checkpoint, args.output, iteration=args.iteration, dtype=args.dtype,
                                   tokenizer=args.tokenizer, overwrite=args.overwrite,
                                   max_shard_bytes=int(args.max_shard_gb * 1e9), progress=not args.no_progress)
            _report(summary, "to-hf")
        else:
            summary = import_from_hf(args.hf, args.output, config=args.config, dtype=args.dtype,
                                     overrides=args.overrides, overwrite=args.overwrite,
                                     progress=not args.no_progress)
            _report(summary, "from-hf")
            print(f"[convert] train from it with: checkpoint.pretrained={summary['output']} "
                  f"(vocabulary padded to {summary['padded_vocab_size']})")
        return 0
    except KeyboardInterrupt:
        print("\n[convert] interrupted; no output written", file=sys.stderr)
        return 130
    except (ConversionError, CheckpointError, ConfigError, OSError) as exc:
        print(f"[convert] error: {exc}", file=sys.stderr)
        return 1

