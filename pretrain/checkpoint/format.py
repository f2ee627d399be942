"""What every checkpoint format shares, in one place: names, the tracker, the commit, and the safe readers (the
formats themselves: `backends.py`).

Layout (Megatron's convention): `iter_0000010/` per checkpoint and `latest_checkpointed_iteration.txt`
naming the newest complete one. A checkpoint directory holds the torch_dist files, their `.metadata` index,
`metadata.json` (the backend), `common.pt` (megatron-core ≤ 0.18; 0.19+ keeps it inside the torch_dist files)
and `run_config.yaml`, written last by the commit: its presence marks a complete checkpoint.

Reading never unpickles untrusted data: `common.pt` and the checkpoint's byte objects go through torch's
weights-only loader, `.metadata` through an allow-list unpickler, and every file the index refers to is
checked to exist and be long enough. The trainer (`save`/`load`/`resume`) and the HF bridge both use this.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import yaml

from pretrain import safe_paths
from pretrain.files import write_atomic
from pretrain.run.run_dir import checkpoint_root  # noqa: F401 (the run directory owns where checkpoints go)

TRACKER = "latest_checkpointed_iteration.txt"
COMMIT_JOURNAL = "commit_in_progress.txt"  # the step being committed: from before run_config.yaml to after the tracker
COMMON_FILE = "common.pt"
INDEX_FILE = ".metadata"
COMMON_OBJECT = "common_state/shard_0_1"  # megatron-core 0.19+: common state inside the torch_dist files
FORMAT_FILE = "metadata.json"
RUN_CONFIG_FILE = "run_config.yaml"  # written by the commit: its presence marks a complete checkpoint


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the file and the reason."""


# --------------------------------------------------------------------------------------------------
# Paths and the tracker
# --------------------------------------------------------------------------------------------------


def iteration_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def latest_iteration(root: Path) -> int | None:
    """The step named by the tracker file, or None when there is no tracker."""
    tracker = root / TRACKER
    if not tracker.exists():
        return None
    try:
        text = tracker.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker}: not a text file (expected an iteration number); restore it or "
                              "delete it to resume from the newest complete checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{tracker}: unreadable ({exc.strerror})") from None
    try:
        step = int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}") from None
    if not iteration_dir(root, step).is_dir():
        raise CheckpointError(f"{tracker}: names iteration {step} but {iteration_dir(root, step)} does not exist")
    return step


STAGE_MARK = "stage_end.txt"  # in a checkpoint that ends a stage: its name (kept whatever checkpoint.keep_last says)
STAGE_LINK = "stage_{name}"  # in the checkpoint root: a link to the checkpoint that ends stage NAME


def name_checkpoint(root: Path, step: int, name: str) -> Path:
    """Mark the checkpoint of `step` as the end of stage `name` (never pruned) and link `root/stage_NAME` to it;
    idempotent (a restart names what a killed run had not)."""
    import os

    path = iteration_dir(root, step)
    mark = path / STAGE_MARK
    if not mark.is_file() or mark.read_text().strip() != name:
        write_atomic(mark, f"{name}\n")
    link = root / STAGE_LINK.format(name=name)
    if not (link.is_symlink() and os.readlink(link) == path.name):
        tmp = root / f".{link.name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        os.replace(tmp, link)
    return link


def ends_a_stage(path: Path) -> bool:
    """True for a checkpoint named for the stage it ends (`name_checkpoint`)."""
    return (path / STAGE_MARK).is_file()


def journal_step(root: Path) -> int | None:
    """The step `COMMIT_JOURNAL` names (a commit that had not finished), None when there is none or it is unreadable."""
    try:
        return int((root / COMMIT_JOURNAL).read_text().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def iterations(root: Path) -> list[int]:
    """Steps of the `iter_*` directories under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit() and p.is_dir())


def is_committed(path: Path) -> bool:
    """True for a checkpoint the save committed: `run_config.yaml` is written (atomically) only after every
    rank finished writing, just before the tracker moves. Without it a directory is a partial save."""
    return (path / RUN_CONFIG_FILE).is_file()


def commit_files(path: Path, run_config_yaml: str, root: Path | None = None, step: int | None = None) -> None:
    """Mark `path` complete: write its `run_config.yaml`, then (given `root`) point the tracker at `step`.

    Each is written atomically, `run_config.yaml` first, so the tracker never names an incomplete checkpoint.
    Given `root`, the journal `COMMIT_JOURNAL` names `step` from before `run_config.yaml` until the tracker has
    moved: a run killed between the two finds it and finishes the commit (`resume.resume_step`).
    """
    target = path / RUN_CONFIG_FILE
    try:
        if root is not None:
            write_atomic(root / COMMIT_JOURNAL, f"{step}\n")
        write_atomic(target, run_config_yaml)
        if root is not None:
            target = root / TRACKER
            write_atomic(target, f"{step}\n")
            (root / COMMIT_JOURNAL).unlink(missing_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{target}: committing the checkpoint failed ({exc.strerror or exc}); "
                              "the tracker was not moved") from None


def agree(error: CheckpointError | None) -> None:
    """Raise the same error on every rank when a check failed on any rank (none is left waiting in a collective)."""
    from pretrain.run.runtime import any_rank_error

    message = any_rank_error(None if error is None else str(error))
    if message is not None:
        raise CheckpointError(message)


# --------------------------------------------------------------------------------------------------
# Reading and checking a checkpoint (no untrusted unpickling)
# --------------------------------------------------------------------------------------------------

_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _RefusedGlobal(pickle.UnpicklingError):
    """A global outside the allow-list of a checkpoint index."""


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a torch_dist `.metadata` index, refusing every global outside the index's own classes."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"global '{module}.{name}' is not allowed in a checkpoint index")


def reason(exc: BaseException) -> str:
    from pretrain.compat.megatron_fixes import informative_line

    return informative_line(exc)



def read_common(path: Path, index=None) -> dict:
    """The checkpoint's common (non-sharded) state through torch's weights-only loader.

    megatron-core ≤ 0.18 writes it to `common.pt`; 0.19+ stores it as the `common_state` object inside the
    torch_dist files. A pickle of arbitrary objects is refused in both.
    """
    import torch

    f = path / COMMON_FILE
    if f.is_file():
        what, source = f, f
    else:
        if index is None and (path / INDEX_FILE).is_file():
            index = read_index(path)
        data = read_object_bytes(path, index, COMMON_OBJECT) if index is not None else None
        if data is None:
            raise CheckpointError(f"{f}: missing (incomplete checkpoint)")
        what, source = f"{path}: object '{COMMON_OBJECT}'", io.BytesIO(data)
    try:
        common = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{what}: refused by the weights-only loader, untrusted pickles are never loaded "
                              f"({reason(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{what}: unreadable, truncated or not a torch file ({reason(exc)})") from None
    if not isinstance(source, Path) and isinstance(common, list) and len(common) == 1:
        common = common[0]  # a ShardedObject's data is stored wrapped in a one-element list
    if not isinstance(common, dict):
        raise CheckpointError(f"{what}: expected a dict of common state, found {type(common).__name__}")
    return common


def read_index(path: Path):
    """The torch_dist `.metadata` index, unpickled with an allow-list."""
    f = path / INDEX_FILE
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (incomplete checkpoint)")
    try:
        with open(f, "rb") as fh:
            return _IndexUnpickler(fh).load()
    except _RefusedGlobal as exc:
        raise CheckpointError(f"{f}: refused, not a torch_dist checkpoint index ({reason(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{f}: unreadable or truncated checkpoint index ({reason(exc)})") from None



SHARDED_BACKENDS = ("torch_dist", "fsdp_dtensor")  # fsdp_dtensor: Megatron-FSDP runs (`fsdp_format.py`)


def write_format_file(path: Path, backend: str) -> None:
    """`metadata.json` as Megatron-Core writes it for a checkpoint of `backend` (one of SHARDED_BACKENDS)."""
    import json

    (path / FORMAT_FILE).write_text(json.dumps({"sharded_backend": backend, "sharded_backend_version": 1,
                                                "common_backend": "torch", "common_backend_version": 1}))


def checkpoint_backend(path: Path) -> str:
    """The sharded backend `metadata.json` names: "torch_dist" or "fsdp_dtensor" (checked)."""
    return _check_format(Path(path))


def _check_format(path: Path) -> str:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    fmt = path / FORMAT_FILE
    if not fmt.is_file():
        legacy = " (a legacy Megatron-LM torch checkpoint; only torch_dist is supported)" if any(
            path.glob("mp_rank_*")) else ""
        raise CheckpointError(f"{path}: not a Megatron-Core distributed checkpoint, {FORMAT_FILE} missing{legacy}")
    try:
        info = json.loads(fmt.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{fmt}: not valid JSON ({exc})") from None
    backend = info.get("sharded_backend") if isinstance(info, dict) else None
    if backend not in SHARDED_BACKENDS:
        raise CheckpointError(f"{fmt}: sharded_backend is {backend!r}, this trainer reads "
                              f"{' or '.join(repr(b) for b in SHARDED_BACKENDS)}")
    return backend


def _check_files(path: Path, index) -> None:
    """Every data file the index refers to exists and holds the bytes the index expects."""
    need: dict[str, int] = {}
    for info in index.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        try:  # the index names its files: never one outside the checkpoint (pretrain/safe_paths.py)
            safe_paths.inside(path, name, "named by the checkpoint index")
        except safe_paths.UnsafePathError as exc:
            raise CheckpointError(str(exc)) from None
        except FileNotFoundError:
            pass
        if not f.is_file():
            raise CheckpointError(f"{f}: missing, the checkpoint index refers to it")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"{f}: truncated, {have} bytes but the checkpoint index needs {size}")



def read_object_bytes(path: Path, index, unique_key: str) -> bytes | None:
    for key, info in index.storage_data.items():
        if key.fqn == unique_key and not getattr(info, "transform_descriptors", None):
            with open(path / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                return fh.read(info.length)
    return None



def inspect_checkpoint(path: str | Path) -> tuple[dict, Any]:
    """Common state and index of a checkpoint directory, checked without untrusted unpickling."""
    path = Path(path)
    _check_format(path)
    index = read_index(path)
    _check_files(path, index)
    return read_common(path, index), index



def _committed(path: Path) -> Path:
    if not is_committed(path):
        raise CheckpointError(f"{path}: an incomplete checkpoint (no {RUN_CONFIG_FILE}: its save never committed)")
    return path


def resolve_checkpoint(path: str | Path, iteration: int | None = None) -> Path:
    """A complete iteration directory from a run dir, a checkpoints dir or an iteration dir itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or run directory")
    if (p / FORMAT_FILE).exists() or p.name.startswith("iter_"):
        return _committed(p)
    for root in (p, p / "checkpoints"):
        if iteration is not None and iteration_dir(root, iteration).exists():
            return _committed(iteration_dir(root, iteration))
        latest = latest_iteration(root) if iteration is None else None
        if latest is not None:
            return _committed(iteration_dir(root, latest))
    what = f"iteration {iteration}" if iteration is not None else f"complete checkpoint ({TRACKER})"
    raise CheckpointError(f"{p}: no {what} found")


def read_saved_config(path: Path) -> dict:
    """The config a checkpoint was written with (from run_config.yaml)."""
    cfg_file = path / RUN_CONFIG_FILE
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no run_config.yaml beside the checkpoint")
    try:
        tree = yaml.safe_load(cfg_file.read_bytes().decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # e.g. a !!python tag: never constructed
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{cfg_file}: not a plain YAML config ({reason})") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{cfg_file}: expected a mapping of config sections, found {type(tree).__name__}")
    return tree



def root_stamp(root: Path) -> dict[str, Any]:
    """What choosing a checkpoint of `root` reads, as a fingerprint (`validate`'s verdict cache,
    `pretrain.rules.start`): the tracker and the commit journal (contents), and per `iter_*` directory the names of
    its files and the size and mtime of its `run_config.yaml`, `metadata.json`, `common.pt` and `.metadata`. A
    changed checkpoint is another stamp; a data file rewritten in place at the same name is not (train's own
    check at start reads the index against the files)."""
    def text(p: Path) -> str | None:
        try:
            return p.read_bytes()[:4096].decode("utf-8", "replace")
        except OSError:
            return None

    out: dict[str, Any] = {"root": str(root), TRACKER: text(root / TRACKER),
                           COMMIT_JOURNAL: text(root / COMMIT_JOURNAL)}
    for step in iterations(root):
        out[iteration_dir(root, step).name] = iteration_stamp(iteration_dir(root, step))
    return out


def iteration_stamp(path: Path) -> dict[str, Any]:
    """The names of the files of one checkpoint directory and the (size, mtime_ns) of its small files (`root_stamp`)."""
    def stat(p: Path) -> list[int] | None:
        try:
            st = p.stat()
            return [st.st_size, st.st_mtime_ns]
        except OSError:
            return None

    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = None
    return {"files": names, **{f: stat(path / f) for f in (RUN_CONFIG_FILE, FORMAT_FILE, COMMON_FILE, INDEX_FILE)}}
