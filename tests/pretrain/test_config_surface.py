"""The config surface through `python -m pretrain validate` (its entry point, in process): every bad input is one
line naming the cause, a non-zero exit and no traceback. Config paths that are no YAML text file (a directory, a
binary or non-UTF-8 file, /dev/zero, a huge file), a key given twice at any level, integer fields (whole numbers
written as floats accepted, 64-bit bounds, the run's sample count, other bounds), `data.split` with a part that is
not a number, MoE keys on a dense model, and document-boundary options with a tokenizer that has no EOD.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.__main__ import main
from pretrain.config import load_config


def _validate(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """(exit status, stdout + stderr, the problem or config-error lines)."""
    rc = main(["validate", *argv])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("config error: ") or ln.strip()[:3] in
             {f"{i}. " for i in range(1, 10)}]
    return rc, text, lines


def _one_config_error(capsys, *argv: str) -> str:
    rc, text, lines = _validate(capsys, *argv)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: "), text
    return lines[0].removeprefix("config error: ")


def _one_problem(capsys, *argv: str) -> str:
    rc, text, lines = _validate(capsys, *argv)
    assert rc == 2 and len(lines) == 1, text
    return lines[0].split(". ", 1)[1]


def test_config_paths_that_are_no_yaml_text(tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    (tmp_path / "binary.yaml").write_bytes(b"model:\x00\x01\x02")
    (tmp_path / "latin1.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    with open(tmp_path / "huge.yaml", "wb") as f:
        f.truncate(5 << 20)  # sparse: 5 MiB of nothing
    line = _one_config_error(capsys, str(tmp_path / "adir"))
    assert line.startswith(f"config file '{tmp_path}/adir' is a directory; give a YAML file (shipped configs: ")
    from pretrain.config import CONFIG_DIR

    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))  # every shipped config, in order
    assert ", llama3_70b, llama3_8b, " in line and line.endswith(f"(shipped configs: {shipped})"), line
    assert _one_config_error(capsys, "/dev/zero") == (
        "config file '/dev/zero' is not a regular file (a device, pipe or socket); give a YAML file")
    assert _one_config_error(capsys, str(tmp_path / "binary.yaml")) == (
        f"config file '{tmp_path}/binary.yaml' is a binary file (it holds NUL bytes), not YAML text")
    assert _one_config_error(capsys, str(tmp_path / "latin1.yaml")) == (
        f"config file '{tmp_path}/latin1.yaml' is not UTF-8 text (byte 0xe9 at offset 16)")
    assert _one_config_error(capsys, str(tmp_path / "huge.yaml")) == (
        f"config file '{tmp_path}/huge.yaml' is 5,242,880 bytes; a config is a YAML file of at most 1,048,576 "
        "bytes (is this the right file?)")
    (tmp_path / "broken.yaml").write_text("model: [\n")
    assert _one_config_error(capsys, str(tmp_path / "broken.yaml")).startswith(
        f"{tmp_path}/broken.yaml: not valid YAML: expected the node content, but found '<stream end>' at line 2")


def test_a_key_given_twice_is_refused_naming_it(tmp_path, capsys):
    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  preset: tiny_llama\n  num_layers: 2\ndata:\n  mock: true\nmodel:\n  num_layers: 3\n")
    assert _one_config_error(capsys, str(twice)) == (
        f"{twice}: 'model' is given twice (line 1, column 1 and line 6, column 1); YAML would keep only the later "
        "one, so remove one of them")
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  preset: tiny_llama\ntrain:\n  steps: 4\n  seed: 1\n  steps: 8\n")
    assert _one_config_error(capsys, str(nested)).startswith(f"{nested}: 'train.steps' is given twice (line 4, ")
    assert _one_config_error(capsys, "tiny_llama", "data.blend={a: 1, a: 2}").startswith(
        "override 'data.blend={a: 1, a: 2}': 'data.blend.a' is given twice (line 1, column 2 and line 1, column 8)")


def test_integer_fields(capsys):
    # Whole numbers written as floats are those integers; fractions and 64-bit overflows are refused at parse.
    cfg = load_config("tiny_llama", ["train.steps=1e3", "train.global_batch_size=8.0"])
    assert (cfg.train.steps, cfg.train.global_batch_size) == (1000, 8) and isinstance(cfg.train.steps, int)
    assert _one_config_error(capsys, "tiny_llama", "train.steps=2.5") == (
        "'train.steps' must be of type int, got 2.5 (float)")
    assert _one_config_error(capsys, "tiny_llama", "train.seed=1e30") == (
        "train.seed=1e30 is out of range (integers must fit in 64 bits, at most 9,223,372,036,854,775,807)")
    # Validation: a sample count no dataset index holds (it passed, then Megatron-Core failed to allocate 3.6 TiB).
    assert _one_problem(capsys, "tiny_llama", "train.steps=1e12") == (
        "[train.steps, train.global_batch_size] train.steps=1,000,000,000,000 x train.global_batch_size=8 = "
        "8,000,000,000,000 samples: Megatron-Core's dataset index holds 24 bytes per sample (175 TiB), beyond any "
        "machine's memory. Fix: train for at most 45,812,984,490 samples (train.steps <= 5,726,623,061 at this "
        "batch size)")
    for override, problem in [
        ("logging.log_interval=0", "[logging.log_interval] logging.log_interval=0 must be at least 1"),
        ("train.seed=-1", "[train.seed] train.seed=-1 must be in [0, 4294967295] (numpy's seed range"),
        ("optimizer.decay_steps=0", "[optimizer.decay_steps] optimizer.decay_steps=0 must be at least 1"),
    ]:
        assert _one_problem(capsys, "tiny_llama", override).startswith(problem), override


def test_split_with_a_part_that_is_not_a_number(capsys):
    # Megatron-Core's own parser keeps 1 and 2 and drops x: refused, with a blend and without one.
    expected = ("[data.split] data.split='1,2,x': 'x' is not a share (a non-negative number); write up to three "
                "shares separated by commas, e.g. '969,30,1'")
    assert _one_problem(capsys, "tiny_llama", "data.split=1,2,x").startswith(expected)
    rc, text, lines = _validate(capsys, "tiny_llama", "data.split=1,2,x", "data.blend=[/nowhere/x_text_document]")
    assert rc == 2 and any(ln.split(". ", 1)[1].startswith(expected) for ln in lines), text
    assert load_config("tiny_llama", ["data.split=99990,8,2"]).data.split == "99990,8,2"
    rc, text, _ = _validate(capsys, "tiny_llama", "data.split=969/30/1")
    assert rc == 0, text


def test_moe_keys_on_a_dense_model(capsys):
    assert _one_problem(capsys, "tiny_llama", "model.moe_router_topk=4", "model.moe_aux_loss_coeff=0.1") == (
        "[model.moe_router_topk, model.moe_aux_loss_coeff, model.num_moe_experts] model.moe_router_topk=4, "
        "model.moe_aux_loss_coeff=0.1 set but the model has no experts (model.num_moe_experts is null): MoE settings "
        "do nothing on a dense model. Fix: remove them, or set model.num_moe_experts for an MoE model")
    rc, text, _ = _validate(capsys, "tiny_moe", "model.moe_router_topk=4", "model.moe_aux_loss_coeff=0.1")
    assert rc == 0, text


@pytest.fixture(scope="module")
def no_eod_dataset(tmp_path_factory) -> tuple[Path, str]:
    """A tokenizer.json without an EOS token (no tokenizer_config.json) and a dataset made with it."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    from data_tools.__main__ import main as data_tools_main

    root = tmp_path_factory.mktemp("noeod")
    words = ["[UNK]", *"the quick brown fox jumps over lazy dog".split()]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 30}) + "\n"
                              for _ in range(8)))
    assert data_tools_main(["preprocess", "--input", str(corpus), "--output-prefix", str(root / "d"),
                            "--tokenizer-type", "huggingface", "--tokenizer-model", str(root / "tok"),
                            "--no-progress"]) == 0
    return root / "tok", str(root / "d_text_document")


@pytest.mark.parametrize("option", ["data.eod_mask_loss", "data.reset_position_ids", "data.reset_attention_mask"])
def test_document_options_need_an_eod_token(capsys, no_eod_dataset, option):
    tok, prefix = no_eod_dataset
    argv = ["tiny_llama", f"data.blend=[{prefix}]", "data.tokenizer_type=huggingface", f"data.tokenizer_model={tok}",
            "model.vocab_size=128", "data.split=1,0,0", "model.transformer_impl=local"]
    extra = ["data.reset_attention_mask=true"] if option == "data.reset_position_ids" else []  # RoPE needs both
    rc, text, lines = _validate(capsys, *argv, f"{option}=true", *extra)
    assert rc == 2, text
    (problem,) = [ln for ln in lines if "EOD" in ln]
    assert f"{option}=true" in problem and ("document boundaries are the tokenizer's EOD tokens, but hf-json "
                                            "tokenizer.json") in problem and "defines none" in problem, problem
    rc, text, _ = _validate(capsys, *argv)
    assert rc == 0, text  # the same run without the option is fine
