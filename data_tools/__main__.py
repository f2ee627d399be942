"""``python -m data_tools {preprocess,inspect,verify,merge,convert,shard-plan,shard-run,finalize} ...`` (imports are
lazy). The last three spread ``preprocess`` over the tasks of a Slurm array (``launch/preprocess.sh``)."""

from __future__ import annotations

import argparse
import signal
import sys

from pretrain.tokenizer.types import TOKENIZER_TYPES


def _add_tokenizer_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--tokenizer-type", required=required, metavar="TYPE", help=f"one of: {', '.join(TOKENIZER_TYPES)}")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json (or its dir), tiktoken .json")
    p.add_argument("--vocab-file", help="vocab.json of a BPE vocab/merges pair (GPT2BPETokenizer)")
    p.add_argument("--merge-file", help="merges.txt of a BPE vocab/merges pair")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("preprocess", help="tokenize a corpus into Megatron .bin/.idx files")
    p.add_argument("--input", nargs="+", required=True, help="JSONL (.gz/.zst) or Parquet files, dirs, globs")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    _add_tokenizer_args(p, required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys / Parquet columns (default: text)")
    p.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer threads (default 1)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    p.add_argument(
        "--keep-empty", action="store_true", help="write empty documents as Megatron-LM does (default: skip)"
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted run with the same arguments")
    p.add_argument("--encoder", choices=["auto", "gigatoken", "reference"], default="auto")
    p.add_argument("--batch-mb", type=float, default=8.0, help="input MB per batch (default 8)")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("inspect", help="counts, dtype, length histogram, sample documents")
    p.add_argument("prefix")
    _add_tokenizer_args(p, required=False)
    p.add_argument("--samples", type=int, default=2, help="documents to decode (needs a tokenizer)")
    p.add_argument("--chars", type=int, default=300, help="characters shown per sample")

    p = sub.add_parser("verify", help="check a .bin/.idx pair for consistency")
    p.add_argument("prefix")
    _add_tokenizer_args(p, required=False)
    p.add_argument("--update-meta", action="store_true",
                   help="after the checks pass, record the index facts (sizes, fingerprint) in PREFIX.meta.json")

    p = sub.add_parser("merge", help="concatenate datasets with the same dtype")
    p.add_argument("--inputs", nargs="+", required=True, help="dataset prefixes (without .bin/.idx)")
    p.add_argument("--output-prefix", required=True)

    sub.add_parser("convert", help="checkpoint conversion (see data_tools.convert)", add_help=False)

    p = sub.add_parser("shard-plan", help="plan a preprocess run over N tasks: shard-plan --tasks N -- PREPROCESS-ARGS")
    p.add_argument("--tasks", type=int, required=True, help="tasks to spread the input files over (by bytes)")
    p.add_argument("--plan", help="where to write the plan (default: OUTPUT_PREFIX.shards.json)")
    p.add_argument("preprocess_args", nargs="*", help="after --: the arguments of `preprocess`")

    p = sub.add_parser("shard-run", help="preprocess one task's share of a plan (resumes an interrupted run)")
    p.add_argument("plan")
    p.add_argument("--task", type=int, help="task index (default: $SLURM_ARRAY_TASK_ID)")

    p = sub.add_parser("finalize", help="check and verify every part of a plan, then merge them or write their blend")
    p.add_argument("plan")
    p.add_argument("--mode", choices=["merge", "blend"], default="merge")
    p.add_argument("--remove-parts", action="store_true", help="delete the parts once merged (--mode merge)")
    return parser


def _shard_command(args: argparse.Namespace) -> int:
    """shard-plan / shard-run / finalize. Each task locks its own part (``PREFIX_partKKKKK.lock`` and its
    datasets' locks), the final step the merged dataset, as ``preprocess`` and ``merge`` do."""
    import os

    from data_tools import shards
    from pretrain.run.output_lock import hold

    if args.command == "shard-plan":
        pre = build_parser().parse_args(["preprocess", *args.preprocess_args])
        # The tokenizer every task uses, decided once: the embedded fallback without files, as preprocess.
        pre.tokenizer_type, pre.tokenizer_model, pre.vocab_file, pre.merge_file = _tokenizer_files(pre)
        plan = shards.make_plan(pre, args.tasks)
        path = args.plan or f"{plan.output_prefix}{shards.PLAN_SUFFIX}"
        shards.write_plan(plan, path)
        total = sum(x["bytes"] for x in plan.inputs)
        sizes = [plan.task_bytes(t) for t in range(len(plan.tasks))]
        print(f"plan {path}: {len(plan.inputs):,} file(s), {total:,} bytes over {len(plan.tasks)} task(s) "
              f"(largest share {max(sizes):,} bytes, smallest {min(sizes):,})", file=sys.stderr)
        if len(plan.tasks) < args.tasks:
            print(f"note: {args.tasks} tasks asked, {len(plan.tasks)} planned: a task's share is whole files",
                  file=sys.stderr)
        print(f"{path} {len(plan.tasks)}")
        return 0
    plan = shards.read_plan(args.plan)
    if args.command == "shard-run":
        task = args.task
        if task is None:
            if not os.environ.get("SLURM_ARRAY_TASK_ID", "").isdigit():
                raise shards.ShardError("give --task K (or run inside a Slurm array job)")
            task = int(os.environ["SLURM_ARRAY_TASK_ID"])
        try:
            with hold(shards.task_targets(plan, task)):
                print(shards.run_task(plan, task, lambda m: print(m, file=sys.stderr, flush=True)))
        except KeyboardInterrupt:
            print(f"\n{plan.describe(task)} interrupted; running it again (a requeue) resumes it", file=sys.stderr)
            return 130
        return 0
    from data_tools.finalize import finalize

    with hold(shards.final_targets(plan)):
        print(finalize(plan, args.mode, remove_parts=args.remove_parts))
    return 0


def _tokenizer_files(args: argparse.Namespace) -> tuple[str, str | None, str | None, str | None]:
    """(type, model, vocab, merges): without files, the embedded tokenizer the trainer falls back to as well
    (`pretrain.tokenizer.embedded`, the one owner of that fallback: the SentencePiece types and GPT2BPETokenizer),
    named in a note on stderr."""
    from pretrain.tokenizer.embedded import with_embedded

    ttype, model, vocab, merges, embedded = with_embedded(args.tokenizer_type, args.tokenizer_model,
                                                          args.vocab_file, args.merge_file)
    if embedded:
        files = " + ".join(f for f in (model, vocab, merges) if f)
        print(f"note: no tokenizer files given: using the embedded {embedded} tokenizer ({files}), as the trainer "
              "does without data.tokenizer_model", file=sys.stderr)
    return ttype, model, vocab, merges


def _tokenizer_from(args: argparse.Namespace) -> object | None:
    if not args.tokenizer_type:
        return None
    from pretrain.tokenizer.load import load_tokenizer

    return load_tokenizer(*_tokenizer_files(args))


def _output_locks(args: argparse.Namespace):
    """One writer per output (``pretrain/run/output_lock.py``): preprocess locks its prefix (its resume state) and
    each dataset it writes, merge its output dataset; a second writer is refused naming the first."""
    from pretrain.run.output_lock import Held, Target, hold

    if args.command == "preprocess":
        p = args.output_prefix
        return hold([Target(p, "preprocess --output-prefix"),
                     *(Target(f"{p}_{k}_document", "dataset") for k in dict.fromkeys(args.json_keys))])
    if args.command == "merge":
        return hold([Target(args.output_prefix, "merge --output-prefix")])
    return Held([])


def _run(args: argparse.Namespace) -> int:
    if args.command in ("shard-plan", "shard-run", "finalize"):
        return _shard_command(args)
    if args.command == "preprocess":
        from data_tools.made_with import NothingToResume
        from data_tools.preprocess import preprocess

        try:
            summary = preprocess(args.input, args.output_prefix, *_tokenizer_files(args), json_keys=args.json_keys,
                                 append_eod=args.append_eod, workers=args.workers, strict=args.strict,
                                 keep_empty=args.keep_empty, resume=args.resume, encoder=args.encoder,
                                 batch_bytes=int(args.batch_mb * (1 << 20)),
                                 progress=False if args.no_progress else None)
        except NothingToResume as e:  # a finished output of these options: nothing is written
            print(e)
            return 0
        print(summary.format())
        return 0
    if args.command == "inspect":
        from data_tools.inspect_cmd import inspect_dataset

        print(inspect_dataset(args.prefix, _tokenizer_from(args), samples=args.samples, chars=args.chars))
        return 0
    if args.command == "verify":
        from data_tools.verify import verify
        from pretrain.tokenizer.identity import describe_tokenizer

        # Only the vocabulary and the identity are needed: no Megatron import (and none of its warnings).
        tok = describe_tokenizer(*_tokenizer_files(args)) if args.tokenizer_type else None
        print(verify(args.prefix, tok, update_meta=args.update_meta))
        return 0
    if args.command == "merge":
        from data_tools.merge import merge

        print(merge(args.inputs, args.output_prefix))
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":
        try:
            from data_tools.convert import main as convert_main
        except ImportError as e:
            print(f"error: the convert subcommand is not available ({e})", file=sys.stderr)
            return 2
        return int(convert_main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    # SIGTERM (e.g. a scheduler's kill) interrupts like Ctrl-C, so an interrupted run can --resume.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    from data_tools.inputs import InputError
    from data_tools.made_with import ResumeRefused
    from data_tools.shards import ShardError
    from pretrain.tokenizer.types import TokenizerError

    try:
        with _output_locks(args):
            return _run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; re-run with --resume to continue", file=sys.stderr)
        return 130
    except (InputError, ShardError, TokenizerError, ResumeRefused, OSError, RuntimeError, ValueError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
