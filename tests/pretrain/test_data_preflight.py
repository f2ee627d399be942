"""Pre-flight checks of data, tokenizer and config through `python -m pretrain train|validate`: every bad
dataset reported at once before the model is built, datasets checked against the run's tokenizer, the
validation gaps of issue 13, and nothing written to run.dir before validation passes.

All command lines run in one worker process (start-up dominates on CPU); each is the CLI's `main(argv)`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.pretrain.cli_worker import run_cases

FAST = ["checkpoint.save_at_end=false", "logging.tensorboard=false", "train.steps=1"]


def _bad_datasets(root: Path, ds: dict[str, str]) -> dict[str, str]:
    """Broken or foreign copies of the small datasets."""
    from data_tools.preprocess import preprocess
    from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB

    def copy(src: str, name: str, *, meta: bool = True, bin_from: str | None = None) -> str:
        dst = str(root / name)
        shutil.copy(f"{src}.idx", f"{dst}.idx")
        shutil.copy(f"{bin_from or src}.bin", f"{dst}.bin")
        if meta:
            shutil.copy(f"{src}.meta.json", f"{dst}.meta.json")
        return dst

    out = {"missing": str(root / "missing_text_document")}
    out["mismatched"] = copy(ds["b"], "mismatched", meta=False, bin_from=ds["a"])  # a's .bin with b's .idx
    out["truncated"] = copy(ds["a"], "truncated")
    data = Path(f"{out['truncated']}.bin").read_bytes()
    Path(f"{out['truncated']}.bin").write_bytes(data[: len(data) // 2])
    out["badheader"] = copy(ds["a"], "badheader")
    idx = Path(f"{out['badheader']}.idx").read_bytes()
    Path(f"{out['badheader']}.idx").write_bytes(b"NOTANIDX!" + idx[9:])
    out["nometa"] = copy(ds["a"], "nometa", meta=False)
    out["gpt2nometa"] = copy(ds["gpt2"], "gpt2nometa", meta=False)
    # Two documents: the default split "969,30,1" leaves the validation split none.
    texts = [json.loads(line)["text"][:3000] for line in Path(ds["a"]).parent.joinpath("a.jsonl").open()][:2]
    (root / "tiny.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([str(root / "tiny.jsonl")], str(root / "tiny"), "sentencepiece", out_tokenizer_model(),
               append_eod=True, progress=False)
    out["tiny"] = str(root / "tiny_text_document")
    # Another tokenizer of the same vocabulary size: GPT-2's vocab.json with two ids swapped.
    vocab = json.loads(GPT2_VOCAB.read_text(encoding="utf-8"))
    vocab["the"], vocab["Ġthe"] = vocab["Ġthe"], vocab["the"]
    swapped = root / "swapped_vocab.json"
    swapped.write_text(json.dumps(vocab), encoding="utf-8")
    preprocess([str(root / "tiny.jsonl")], str(root / "swapped"), "GPT2BPETokenizer", None, str(swapped),
               str(GPT2_MERGES), append_eod=True, progress=False)
    out["swapped"] = str(root / "swapped_text_document")
    # A tokenizer.json without an EOS token (no tokenizer_config.json beside it).
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    (root / "hf_no_eos").mkdir()
    tok.save(str(root / "hf_no_eos" / "tokenizer.json"))
    out["hf_no_eos"] = str(root / "hf_no_eos")
    return out


def out_tokenizer_model() -> str:
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    return str(MISTRAL_TOKENIZER)


@pytest.fixture(scope="module")
def cases(small_datasets, tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    ds = {**small_datasets, **_bad_datasets(root, small_datasets)}
    run = {}

    def train(name: str, *overrides: str, config: str = "tiny_llama") -> list[str]:
        run[name] = root / "runs" / name
        return ["train", config, f"run.dir={run[name]}", *FAST, *overrides]

    every_bad = (f"data.blend=[0.2,{ds['missing']},0.2,{ds['mismatched']},0.2,{ds['truncated']},"
                 f"0.2,{ds['badheader']},0.2,{ds['gpt2']}]")
    cases = {
        "every_bad_train": train("every_bad_train", every_bad),
        "every_bad_validate": ["validate", "tiny_llama", every_bad],
        "scan_without_meta": train("scan_without_meta", f"data.blend=[{ds['gpt2nometa']}]"),
        "runtime_id_guard": {"argv": train("runtime_id_guard", f"data.blend=[{ds['gpt2nometa']}]"),
                             "set": {"pretrain.data.check:SCAN_LIMIT_BYTES": 0}},
        "nometa_trains": train("nometa_trains", f"data.blend=[{ds['nometa']}]"),
        "equal_vocab_mismatch": train("equal_vocab_mismatch", f"data.blend=[{ds['swapped']}]", config="tiny_gpt"),
        "mismatch_allowed": train("mismatch_allowed", f"data.blend=[{ds['swapped']}]",
                                  "data.allow_tokenizer_mismatch=true", config="tiny_gpt"),
        "empty_valid_split": train("empty_valid_split", f"data.blend=[{ds['tiny']}]", "train.eval_interval=1"),
        "empty_valid_unread": train("empty_valid_unread", f"data.blend=[0.5,{ds['tiny']},0.5,{ds['a']}]"),
        "negative_weight": train("negative_weight", f"data.blend=[-0.5,{ds['a']},1.5,{ds['b']}]"),
        "tokenizer_missing": train("tokenizer_missing", "data.tokenizer_model=/nonexistent/tokenizer.model"),
        "hf_no_eos": train("hf_no_eos", "data.tokenizer_type=huggingface", f"data.tokenizer_model={ds['hf_no_eos']}",
                           config="tiny_gpt"),
        "lr_negative": train("lr_negative", "optimizer.lr=-1", "optimizer.min_lr=-2"),
        "steps_zero": train("steps_zero", "train.steps=0", "optimizer.min_lr=1"),
        "pretrained_missing": train("pretrained_missing", f"checkpoint.pretrained={root}/no_such_run"),
        "llama3_needs_tokenizer": ["validate", "llama3_8b", f"data.blend=[{ds['a']}]", "--world-size", "8"],
        "resume_base": train("resume", f"data.blend=[{ds['a']}]", "checkpoint.save_at_end=true"),
        "resume_other_shape": train("resume", f"data.blend=[{ds['a']}]", "model.hidden_size=256",
                                    "train.steps=2"),
    }
    results = run_cases(cases, root / "worker", timeout=600)
    return results, run, ds


def _lines(res: dict) -> list[str]:
    return [ln for ln in res["stderr"].splitlines() if ln.strip()]


def test_every_bad_dataset_reported_at_once_before_the_model(cases):
    results, run, ds = cases
    for name in ("every_bad_train", "every_bad_validate"):
        res = results[name]
        assert res["rc"] == 2 and res["traceback"] is None, res
        err = res["stderr"]
        assert "config check failed: 6 problem(s)" in err, err
        assert f"[data.blend] {ds['missing']}: no dataset there ({ds['missing']}.idx and {ds['missing']}.bin " \
               "not found)" in err
        assert f"{ds['mismatched']}.bin: " in err and "but the index describes" in err  # a's .bin, b's .idx
        assert f"{ds['truncated']}.bin: " in err and "(truncated)" in err
        assert f"{ds['badheader']}.idx: not a Megatron indexed dataset index (bad magic header)" in err
        assert (f"[data.blend, data.tokenizer_model] {ds['gpt2']} was made with bpe-pair vocab.json + merges.txt "
                "(sha256 ") in err and "but this run uses sentencepiece tokenizer.model" in err
        assert f"{ds['gpt2']}: largest token id 50,256 (from gpt2_text_document.meta.json) is not below the " \
               "model's vocabulary of 32,000" in err
    assert "[pretrain] model" not in results["every_bad_train"]["stdout"]  # refused before building it
    assert not run["every_bad_train"].exists()


def test_largest_id_without_metadata_scanned_or_checked_per_batch(cases):
    results, run, ds = cases
    res = results["scan_without_meta"]
    assert res["rc"] == 2, res
    assert f"{ds['gpt2nometa']}: largest token id 50,256 (from a scan of gpt2nometa.bin)" in res["stderr"]
    assert f"warning: {ds['gpt2nometa']} has no gpt2nometa.meta.json (made by another tool?)" in res["stderr"]
    # Above the scan limit the trainer checks every batch and stops with one line (exit 3), not an IndexError.
    res = results["runtime_id_guard"]
    assert res["rc"] == 3 and res["traceback"] is None, res
    assert "token ids are checked batch by batch while training" in res["stdout"]
    assert _lines(res)[-1].startswith("[pretrain] error: sample "), res["stderr"]
    assert "outside the model's vocabulary of 32000" in _lines(res)[-1]
    assert json.loads((run["runtime_id_guard"] / "exit_status.json").read_text())["reason"] == "failed"


def test_dataset_tokenizer_must_match_the_runs(cases):
    results, _, ds = cases
    res = results["nometa_trains"]
    assert res["rc"] == 0, res
    warnings = [ln for ln in res["stdout"].splitlines() if "warning" in ln]
    assert warnings == [f"[pretrain] warning: {ds['nometa']} has no nometa.meta.json (made by another tool?): its "
                        "tokenizer cannot be checked against the run's"]
    res = results["equal_vocab_mismatch"]
    assert res["rc"] == 2, res
    (line,) = [ln for ln in res["stderr"].splitlines() if "was made with" in ln]
    # Same kind and vocabulary size, different files: named both, refused, and the override is named.
    assert "made with bpe-pair swapped_vocab.json + merges.txt (sha256 47cca4008825, vocabulary 50,257" in line
    assert "but this run uses bpe-pair vocab.json + merges.txt (sha256 c62384c9e92b, vocabulary 50,257" in line
    assert "data.allow_tokenizer_mismatch=true" in line
    res = results["mismatch_allowed"]
    assert res["rc"] == 0, res
    assert "allowed by data.allow_tokenizer_mismatch=true" in res["stdout"]


def test_empty_split_refused_only_when_read(cases):
    results, run, ds = cases
    res = results["empty_valid_split"]
    assert res["rc"] == 2, res
    assert (f"[data.blend, data.split] {ds['tiny']}: 2 document(s); data.split='969,30,1' leaves the validation "
            "split 0 document(s) with 0 tokens") in res["stderr"]
    # The same 2-document dataset in a weighted blend without evaluation trains (the empty splits are not built).
    assert results["empty_valid_unread"]["rc"] == 0, results["empty_valid_unread"]


EXPECTED = {
    "negative_weight": ["[data.blend] data.blend weight -0.5 of "],
    "tokenizer_missing": ["tokenizer: SentencePiece --tokenizer-model not found: /nonexistent/tokenizer.model"],
    "hf_no_eos": ["[data.mock, data.tokenizer_model] mock data ends every document with the tokenizer's EOD token, "
                  "but hf-json tokenizer.json (sha256 "],
    "lr_negative": ["[optimizer.lr] optimizer.lr=-1.0 must be a finite number, 0 or more",
                    "[optimizer.min_lr] optimizer.min_lr=-2.0 must be a finite number, 0 or more"],
    "steps_zero": ["[train.steps] train.steps=0 must be at least 1",
                   "[optimizer.min_lr, optimizer.lr] optimizer.min_lr=1.0 is above optimizer.lr=0.001"],
    "pretrained_missing": ["[checkpoint.pretrained] checkpoint.pretrained: ", "no such checkpoint or run directory"],
    "llama3_needs_tokenizer": ["[data.tokenizer_type, data.tokenizer_model] data.tokenizer_type=huggingface needs "
                               "data.tokenizer_model (a tokenizer.json or its directory); no HuggingFace tokenizer "
                               "is embedded"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_validation_gaps_refused_before_anything_is_written(cases, name):
    results, run, _ = cases
    res = results[name]
    assert res["rc"] == 2 and res["traceback"] is None, res
    for text in EXPECTED[name]:
        assert text in res["stderr"], res["stderr"]
    if name in run:
        assert not run[name].exists()  # no config.yaml, no data_cache/


def test_failed_resume_keeps_the_runs_config(cases):
    results, run, _ = cases
    assert results["resume_base"]["rc"] == 0, results["resume_base"]
    assert results["resume_other_shape"]["rc"] != 0
    saved = (run["resume"] / "config.yaml").read_text()
    assert "hidden_size: 128" in saved and "hidden_size: 256" not in saved
