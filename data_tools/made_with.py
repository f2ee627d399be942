"""What a ``preprocess`` output is made with: the options its bytes depend on, described and compared (one owner).

``preprocess --resume`` compares this run's options with its resume state's (an interrupted run) or with a finished
output's ``PREFIX.meta.json``; ``shard-run`` / ``finalize`` compare a part's metadata with the plan's options
(``data_tools.shards.option_differences``). Compared: the tokenizer (its identity: kind and the SHA-256 of its
files, so the same files elsewhere match), ``append_eod``, ``keep_empty``, the JSON keys, ``strict`` (an output
made without it may have skipped lines a strict run refuses; the other way round the bytes are the same) and the
input files (resolved path and size). ``workers``, ``encoder`` and the batch size give the same bytes and are not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def options(spec: Any, keys: list[str], append_eod: bool, keep_empty: bool, strict: bool,
            files: list[Path]) -> dict[str, Any]:
    """This run's options as a JSON-able dict (also stored in the resume state); the tokenizer is not loaded."""
    from pretrain.tokenizer.identity import spec_sha256

    tok_files, sha = spec_sha256(spec)
    return {"tokenizer": tokenizer_text(spec.kind, tok_files, sha), "tokenizer_sha256": sha,
            "append_eod": bool(append_eod), "keep_empty": bool(keep_empty), "json_keys": list(keys),
            "strict": bool(strict), "inputs": [[str(p.resolve()), p.stat().st_size] for p in files]}


def from_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The options a finished output's ``PREFIX.meta.json`` records (one JSON key per output)."""
    made = meta.get("tokenizer") or {}
    return {"tokenizer": tokenizer_text(made.get("kind"), made.get("files"), made.get("sha256")),
            "tokenizer_sha256": made.get("sha256"), "append_eod": meta.get("append_eod"),
            "keep_empty": meta.get("keep_empty"), "json_keys": [meta.get("json_key")], "strict": meta.get("strict"),
            "inputs": [[x.get("path"), x.get("bytes")] for x in meta.get("inputs") or [] if isinstance(x, dict)]}


def tokenizer_text(kind: object, files: object, sha: object) -> str:
    """``KIND FILE + FILE (sha256 …)``."""
    names = " + ".join(Path(str(f)).name for f in files) if isinstance(files, (list, tuple)) else "?"
    return f"{kind} {names or 'no files'} (sha256 {str(sha)[:12]})"


def describe(o: dict[str, Any]) -> str:
    """One line: tokenizer, append_eod, keep_empty, JSON keys, strict, inputs."""
    inputs = o.get("inputs")
    files = f"{len(inputs)} input file(s), {sum(int(b or 0) for _, b in inputs):,} bytes" if inputs else "inputs ?"
    return (f"tokenizer {o.get('tokenizer')}, append_eod {o.get('append_eod')}, keep_empty {o.get('keep_empty')}, "
            f"json keys {' '.join(map(str, o.get('json_keys') or [])) or '?'}, strict {o.get('strict')}, {files}")


def differences(made: dict[str, Any], want: dict[str, Any], made_name: str, want_name: str,
                keys: bool = True, inputs: bool = True) -> list[str]:
    """How `made` (an output's or a state's options) differs from `want` (this run's), one
    ``"option: MADE_NAME X, WANT_NAME Y"`` each. `keys`: compare the JSON keys (an output holds one of them: it
    must be among `want`'s); `inputs`: compare the input files."""
    diffs = []
    if made.get("tokenizer_sha256") != want.get("tokenizer_sha256"):
        diffs.append(f"tokenizer: {made_name} {made.get('tokenizer')}, {want_name} {want.get('tokenizer')}")
    for name in ("append_eod", "keep_empty"):
        if made.get(name) != want.get(name):
            diffs.append(f"{name}: {made_name} {made.get(name)!r}, {want_name} {want.get(name)!r}")
    if keys and not set(made.get("json_keys") or [None]) <= set(want.get("json_keys") or []):
        diffs.append(f"json keys: {made_name} {made.get('json_keys')}, {want_name} {want.get('json_keys')}")
    if want.get("strict") and made.get("strict") is not True:
        diffs.append(f"strict: {made_name} {made.get('strict')!r} (bad lines may have been skipped), {want_name} True")
    if inputs and made.get("inputs") != want.get("inputs"):
        diffs.append(f"inputs: {made_name} {_inputs(made)}, {want_name} {_inputs(want)}")
    return diffs


def _inputs(o: dict[str, Any]) -> str:
    inputs = o.get("inputs") or []
    names = ", ".join(f"{Path(str(p)).name} ({int(b or 0):,} bytes)" for p, b in inputs[:3])
    return f"{names}{f' and {len(inputs) - 3} more' if len(inputs) > 3 else ''}" if inputs else "none recorded"


class ResumeRefused(RuntimeError):
    """``--resume`` cannot continue: the state or the finished output is of other options (both named)."""


class NothingToResume(RuntimeError):
    """``--resume`` of an output that is complete and made with these options: nothing is done."""


def resume_state(want: dict[str, Any], state_path: Path, fingerprint: str, prefixes: list[str],
                 log) -> dict[str, Any] | None:
    """What ``preprocess --resume`` continues from: the state of an interrupted run of the same inputs and
    options; None (start from the beginning, said on `log`) when there is neither a state nor a finished output.
    Raises ``ResumeRefused`` for a state or a finished output of other inputs or options (both named) and
    ``NothingToResume`` for a finished output of these."""
    import json

    from pretrain.dataset_format.indexed import bin_path, idx_path
    from pretrain.dataset_format.metadata import MetadataError, meta_path, read_meta

    again = "run without --resume to start over (replacing it), or with its options"
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise ResumeRefused(f"--resume: {state_path} is unreadable ({e}); {again}") from None
        if state.get("fingerprint") == fingerprint:
            return state
        made = state.get("options")
        if not isinstance(made, dict):
            raise ResumeRefused(f"--resume: {state_path} is of an interrupted run with other inputs or options (not "
                                f"recorded: an older data_tools); this run: {describe(want)}; {again}")
        diffs = differences(made, want, "the interrupted run's", "this run's") or [
            "inputs: the same files and sizes, modified since (another mtime)"]
        raise ResumeRefused(f"--resume: {state_path} is of an interrupted run with other inputs or options "
                            f"({'; '.join(diffs)}). It was made with {describe(made)}; this run asks for "
                            f"{describe(want)}; {again}")
    done = [p for p in prefixes if bin_path(p).is_file() and idx_path(p).is_file()]
    if not done:
        print(f"note: --resume: nothing to resume (no {state_path.name}, no output): starting from the beginning",
              file=log)
        return None
    made_all = []
    for p in done:
        try:
            meta = read_meta(p)
        except MetadataError as e:
            raise ResumeRefused(f"nothing to resume: {p} is complete but {e}; run without --resume to replace it") \
                from None
        if meta is None:
            raise ResumeRefused(f"nothing to resume: {p} is complete and has no {meta_path(p).name} recording the "
                                "options it was made with (another tool's?); run without --resume to replace it")
        made = from_meta(meta)
        diffs = differences(made, want, "the output's", "this run's")
        if diffs:
            raise ResumeRefused(f"nothing to resume: {p} is complete, made with other inputs or options "
                                f"({'; '.join(diffs)}). It was made with {describe(made)}; this run asks for "
                                f"{describe(want)}; run without --resume to replace it, or with its options")
        made_all.append(p)
    if len(done) < len(prefixes):
        missing = [p for p in prefixes if p not in done]
        raise ResumeRefused(f"nothing to resume: {', '.join(done)} complete but {', '.join(missing)} missing, and no "
                            f"{state_path.name}; run without --resume to make them all")
    raise NothingToResume(f"nothing to resume: the output {', '.join(made_all)} is complete, made with "
                          f"{describe(want)}")
