"""HF bridge for DeepseekV3ForCausalLM beyond the per-family round trips of test_hf_families.py: the random model's
routing really exercises group limiting (it changes the chosen experts) and the expert bias; the checkpoint keeps
the MTP layer and the fp32 expert bias as Megatron stores them; weights saved without the MTP layer import without
MTP (with a note); every config field we cannot honour is refused with one line naming it, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_tools.convert import main

from .hf_families import CONFIGS, hf_model, write_hf_model

FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    from .hf_families import tokenizer_files

    return {"sentencepiece": tokenizer_files("sentencepiece", tmp_path_factory.mktemp("tok") / "sp")}


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizers) -> Path:
    return write_hf_model(FAMILY, tmp_path_factory.mktemp("hf") / "model", tokenizers)


def _routes(gate, hidden: torch.Tensor, grouped: bool) -> torch.Tensor:
    """The experts transformers' router chooses (sorted), with or without its group limit."""
    if grouped:
        return gate(hidden)[2].sort(dim=-1).values
    scores = torch.sigmoid(hidden.reshape(-1, hidden.shape[-1]) @ gate.weight.t()) + gate.e_score_correction_bias
    return scores.topk(gate.top_k, dim=-1).indices.sort(dim=-1).values


def test_random_model_routing_uses_groups_and_the_bias(source):
    model = hf_model(source)
    tokens = torch.randint(0, CONFIGS[FAMILY]["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    gate = model.model.layers[1].mlp.gate
    seen = []
    handle = gate.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    with torch.no_grad():
        model(tokens)
        handle.remove()
        grouped, plain = _routes(gate, seen[0], True), _routes(gate, seen[0], False)
    changed = (grouped != plain).any(dim=-1).float().mean().item()
    print(f"group limiting (top-1 of 2 groups) changes the chosen experts of {changed:.0%} of the tokens")
    distinct = len({tuple(x) for x in grouped.tolist()})
    assert 0.05 < changed < 1 and distinct > 4 and gate.e_score_correction_bias.abs().min() > 0


def test_checkpoint_holds_the_mtp_layer_and_the_fp32_bias(tmp_path, source):
    from pretrain.hf.readers import CheckpointReader

    assert main(["from-hf", "--hf", str(source), "--output", str(tmp_path / "ckpt"), "--no-progress",
                 "train.precision=bf16", "--dtype", "bf16"]) == 0
    stored = CheckpointReader(tmp_path / "ckpt").tensors
    assert tuple(stored["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"].size) == (8, 64, 64)
    assert tuple(stored["decoder.layers.0.mlp.linear_fc1.weight"].size) == (192, 64)  # the dense first layer
    assert "decoder.layers.0.mlp.router.weight" not in stored and "mtp.layers.0.eh_proj.weight" in stored
    assert stored["embedding.word_embeddings.weight"].properties.dtype == torch.bfloat16
    # --dtype bf16 casts the weights; the expert bias keeps the source's fp32 (Megatron holds it in fp32), and the
    # export writes it so.
    assert stored["decoder.layers.1.mlp.router.expert_bias"].properties.dtype == torch.float32
    assert main(["to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "back"),
                 "--no-progress"]) == 0
    from .hf_families import safetensors_dir

    back = safetensors_dir(tmp_path / "back")
    assert back["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert back["model.layers.3.shared_head.head.weight"].dtype == torch.bfloat16
    assert torch.equal(back["model.layers.3.embed_tokens.weight"], back["model.embed_tokens.weight"])


def test_weights_without_the_mtp_layer_import_without_mtp(tmp_path, source, capsys):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "no_mtp"
    src.mkdir()
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            kept = {k: v for k, v in load_file(str(f)).items() if not k.startswith("model.layers.3.")}
            save_file(kept, str(src / f.name))
        elif f.name != "model.safetensors.index.json":
            (src / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()
    assert main(["from-hf", "--hf", str(src), "--output", str(tmp_path / "ckpt"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "num_nextn_predict_layers=1 but the weights have no MTP layer (model.layers.3.*" in err
    run_config = (tmp_path / "ckpt" / "run_config.yaml").read_text()
    assert "mtp_num_layers: null" in run_config


def _edit(source: Path, out: Path, **changes) -> Path:
    out.mkdir(parents=True)
    for f in source.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = {**json.loads((out / "config.json").read_text()), **changes}
    (out / "config.json").write_text(json.dumps(config))
    return out


BAD = {
    "softmax scores": ({"scoring_func": "softmax"}, "config.json: scoring_func='softmax' is not supported"),
    "greedy top-k": ({"topk_method": "greedy"}, "config.json: topk_method='greedy' is not supported"),
    "no renormalisation": ({"norm_topk_prob": False}, "config.json: norm_topk_prob=False is not supported"),
    "plain rope layout": ({"rope_interleave": False}, "config.json: rope_interleave=False is not supported"),
    "group rule": ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
                   "config.json: topk_group=2 is not supported (Megatron-Core ranks groups by their top "
                   "num_experts_per_tok/topk_group scores, transformers by 2)"),
    "topk_group above n_group": ({"n_group": 2, "topk_group": 4},  # blamed on topk_group, not on n_group
                                 "config.json: topk_group=4 is not supported (at most n_group=2 groups to choose"),
    "moe every other layer": ({"moe_layer_freq": 2}, "config.json: moe_layer_freq=2 is not supported"),
    "yarn truncate": ({"rope_scaling": {**CONFIGS[FAMILY]["rope_scaling"], "truncate": False}},
                      "config.json: rope_scaling.truncate=false is not supported"),
    "attention factor": ({"rope_scaling": {**CONFIGS[FAMILY]["rope_scaling"], "attention_factor": 2.0}},
                         "config.json: rope_scaling.attention_factor=2.0 is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_field_we_cannot_honour_is_one_line(tmp_path, source, capsys, case):
    changes, message = BAD[case]
    src = _edit(source, tmp_path / "hf", **changes)
    out = tmp_path / "out" / "ckpt"
    capsys.readouterr()
    assert main(["from-hf", "--hf", str(src), "--output", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[convert] error: ") and message in err[0], err
    assert not out.exists()


def test_an_mtp_copy_that_differs_from_the_model_is_refused(tmp_path, source, capsys):
    from safetensors.torch import load_file, save_file

    src = _edit(source, tmp_path / "hf")
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        if "model.layers.3.embed_tokens.weight" in tensors:
            tensors["model.layers.3.embed_tokens.weight"] = tensors["model.layers.3.embed_tokens.weight"] + 1
            save_file(tensors, str(f))
    capsys.readouterr()
    assert main(["from-hf", "--hf", str(src), "--output", str(tmp_path / "ckpt"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF tensor 'model.layers.3.embed_tokens.weight' differs from 'model.embed_tokens.weight'" \
        in err[0], err
