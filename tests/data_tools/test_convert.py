"""HF bridge (`python -m data_tools convert`): exact logits both ways, bit-identical round trip, bounded
memory, refusals. Megatron logits come from a 1-rank gloo process (convert_worker.py); the layout tests
train on pool ranks and are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_tools.convert import main
from model_providers import get_family
from model_providers.core.family import dims, hf_parameter_shapes
from model_providers.core.mapping import ConversionError
from pretrain.hf.export import export_to_hf, plan_export
from pretrain.hf.hf_import import import_from_hf
from pretrain.hf.tokenizer import hf_tokenizer
from tests.cli import Result, run_cli
from tests.data_tools.hf_random import write_random_hf
from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text

pytestmark = pytest.mark.mcore  # the HF bridge over Megatron-Core checkpoints

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("convert_worker.py")
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return LlamaConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The embedded Mistral tokenizer as a transformers tokenizer directory (built once)."""
    from pretrain.config import DataConfig

    d = tmp_path_factory.mktemp("tok")
    hf_tokenizer(DataConfig()).save_pretrained(str(d))
    return d


def random_llama(directory: Path, tokenizer_dir: Path, **kw) -> Path:
    write_random_hf(directory, llama_config(**kw), seed=1, std=0.05)
    for f in tokenizer_dir.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    return directory


def run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def to_hf(run_dir: Path, out: Path) -> Result:
    """`python -m data_tools convert to-hf` of a trained run, in this process (the export is plain file I/O)."""
    argv = ["convert", "to-hf", "--checkpoint", str(run_dir), "--output", str(out), "--no-progress"]
    r = run_cli("data_tools", argv, cwd=ROOT)
    assert r.rc == 0, f"data_tools {' '.join(argv)} failed:\n{r}"
    return r


def megatron_logits(ckpt: Path, tokens: torch.Tensor, tmp: Path) -> torch.Tensor:
    torch.save(tokens, tmp / "tokens.pt")
    log = tmp / "logits.log"
    rc = run_case(1, "tests.data_tools.convert_worker", ["logits", str(ckpt), str(tmp / "tokens.pt"),
                                                         str(tmp / "logits.pt")], log, timeout=600)
    assert rc == 0, log_text(log)[-3000:]
    return torch.load(tmp / "logits.pt", weights_only=True)


def exported_logits(run_dir: Path, tmp: Path, length: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """`convert to-hf` of a trained run, then (config.json, Megatron's logits, transformers' logits) on 2 random
    sequences of `length` tokens."""
    out = tmp / "hf"
    to_hf(run_dir, out)
    config = json.loads((out / "config.json").read_text())
    tokens = torch.randint(0, config["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))
    return config, megatron_logits(run_dir, tokens, tmp), hf_logits(out, tokens)


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# --------------------------------------------------------------------------------------------------
# Export planning
# --------------------------------------------------------------------------------------------------


def test_export_plan_rejects_unknown_and_misshapen_tensors():
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    from pretrain.config import load_config

    m = load_config(None, ["model.preset=tiny_llama"]).model
    d = dims(m, 32000, 32000)
    cfg = get_family("llama").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)
    expected = hf_parameter_shapes(cfg)

    def md(*shape):
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [])

    tensors = {
        "embedding.word_embeddings.weight": md(32000, 128), "output_layer.weight": md(32000, 128),
        "decoder.final_layernorm.weight": md(128),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": md(4, 128),
        "decoder.layers.self_attention.linear_qkv.weight": md(4, 256, 128),
        "decoder.layers.self_attention.linear_proj.weight": md(4, 128, 128),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": md(4, 128),
        "decoder.layers.mlp.linear_fc1.weight": md(4, 704, 128),
        "decoder.layers.mlp.linear_fc2.weight": md(4, 128, 352),
    }
    units = plan_export("llama", tensors, d, 4, expected, torch.float32)
    assert sum(len(u.entries) for u in units) == len(expected) == 2 + 1 + 4 * 9
    with pytest.raises(ConversionError, match="'decoder.layers.self_attention.q_layernorm.weight' is not in"):
        plan_export("llama", {**tensors, "decoder.layers.self_attention.q_layernorm.weight": md(4, 32)}, d, 4,
                    expected, torch.float32)
    with pytest.raises(ConversionError, match="'decoder.layers.mlp.linear_fc2.weight'.*expects"):
        plan_export("llama", {**tensors, "decoder.layers.mlp.linear_fc2.weight": md(4, 128, 350)}, d, 4, expected,
                    torch.float32)
    with pytest.raises(ConversionError, match="'lm_head.weight' has no source"):
        plan_export("llama", {k: v for k, v in tensors.items() if k != "output_layer.weight"}, d, 4, expected,
                    torch.float32)


# --------------------------------------------------------------------------------------------------
# HF → Megatron → HF
# --------------------------------------------------------------------------------------------------


def test_import_matches_hf_logits_and_export_is_bit_identical(tmp_path, tokenizer_dir):
    src = random_llama(tmp_path / "hf", tokenizer_dir)
    ckpt = tmp_path / "ckpt"
    summary = import_from_hf(src, ckpt, progress=False)
    assert summary["padded_vocab_size"] == 32000 and (ckpt / "run_config.yaml").exists()
    tokens = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(src, tokens)
    got = megatron_logits(ckpt, tokens, tmp_path)
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    print(f"HF → Megatron logits max abs diff {diff:.3g}")
    assert diff <= 1e-4

    back = tmp_path / "back"
    export_to_hf(ckpt, back, max_shard_bytes=3_000_000, progress=False)
    assert len(list(back.glob("model-*-of-*.safetensors"))) > 1
    index = json.loads((back / "model.safetensors.index.json").read_text())
    original, exported = safetensors_dir(src), safetensors_dir(back)
    assert set(index["weight_map"]) == set(exported) == set(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    assert torch.equal(hf_logits(back, tokens), ref)

    half = tmp_path / "bf16"
    export_to_hf(ckpt, half, dtype="bf16", tokenizer=str(tokenizer_dir), progress=False)
    for name, t in safetensors_dir(half).items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, original[name].to(torch.bfloat16)), name
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"


def test_refusals_name_the_cause(tmp_path, tokenizer_dir, capsys):
    src = random_llama(tmp_path / "hf", tokenizer_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["from-hf", "--hf", str(src), "--output", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty (pass --overwrite" in err[0]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ConversionError, match="would replace the input"):
        import_from_hf(src, tmp_path, overwrite=True, progress=False)

    # An unknown tensor in the HF files is named; nothing (not even a staging dir) is left behind.
    from safetensors.torch import load_file, save_file

    f = next(src.glob("*.safetensors"))
    weights = load_file(str(f))
    save_file({**weights, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, str(f))
    with pytest.raises(ConversionError, match="'model.layers.0.self_attn.q_norm.weight' is not in the llama"):
        import_from_hf(src, tmp_path / "ckpt", progress=False)
    save_file({**weights, "model.layers.1.mlp.up_proj.weight": torch.ones(95, 64)}, str(f))
    with pytest.raises(ConversionError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \[95, 64\]"):
        import_from_hf(src, tmp_path / "ckpt", progress=False)
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, str(f))
    with pytest.raises(ConversionError, match="'model.norm.weight' is missing"):
        import_from_hf(src, tmp_path / "ckpt", progress=False)
    (src / "model.safetensors.index.json").unlink()
    for g in src.glob("*.safetensors"):
        g.rename(g.with_suffix(".bin"))
    with pytest.raises(ConversionError, match="only safetensors"):
        import_from_hf(src, tmp_path / "ckpt", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]

    assert main(["to-hf", "--checkpoint", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")]) == 1
    assert "no such checkpoint" in capsys.readouterr().err


def test_memory_is_bounded_by_the_largest_tensor(tmp_path, tokenizer_dir):
    """~330 MB of fp32 weights (largest tensor: the 65.5 MB embedding) convert both ways in a process whose
    peak RSS exceeds that of the same conversions of a 2-layer model by at most 3 × the largest tensor."""
    small = random_llama(tmp_path / "small", tokenizer_dir)
    big = random_llama(tmp_path / "big", tokenizer_dir, hidden_size=512, intermediate_size=1536,
                       num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4)
    model_bytes = sum(t.numel() * 4 for t in safetensors_dir(big).values())
    largest = 32000 * 512 * 4
    assert model_bytes > 300e6
    peaks = {}
    for name, src in (("small", small), ("big", big)):
        (tmp_path / f"w_{name}").mkdir()
        r = run([PY, str(WORKER), "memory", str(src), str(tmp_path / f"w_{name}")])
        peaks[name] = json.loads(r.stdout.strip().splitlines()[-1])
    growth = {k: peaks["big"][k] - peaks["small"][k] for k in ("from_hf", "both")}
    print(f"model {model_bytes / 1e6:.0f} MB, largest tensor {largest / 1e6:.1f} MB; peak RSS of the big vs the "
          f"2-layer conversion: from-hf +{growth['from_hf'] / 1e6:.0f} MB, from-hf + to-hf +{growth['both'] / 1e6:.0f}"
          f" MB (2-layer peak {peaks['small']['both'] / 1e6:.0f} MB)")
    assert max(growth.values()) <= 3 * largest < model_bytes
    assert torch.equal(safetensors_dir(tmp_path / "w_big" / "back")["model.embed_tokens.weight"],
                       safetensors_dir(big)["model.embed_tokens.weight"])


# --------------------------------------------------------------------------------------------------
# Trained at TP2 × PP2 (× VP2) → transformers (continued pretraining per family: test_hf_families.py)
# --------------------------------------------------------------------------------------------------


def train(world: int, config: str, run_dir: Path, *overrides: str) -> None:
    """`pretrain train` (its entry point) on `world` pool ranks: 2 steps, saved at the end."""
    argv = ["train", config, f"run.dir={run_dir}", "train.steps=2", "checkpoint.interval=2",
            "logging.tensorboard=false", *overrides]
    log = run_dir.parent / "train.log"
    rc = run_case(world, "pretrain.__main__", argv, log, timeout=600, env={"PYTHONWARNINGS": "ignore"})
    assert rc == 0, log_text(log)[-3000:]


@pytest.mark.slow
# tiny_gpt (tied embeddings: the last stage's output layer is the first stage's embedding): at PP2 (world 2) in
# `make test`, at TP2 × PP2 (world 4) in `make test-all`. The TP2 export (vocabulary padded for TP2, unpadded on
# export) is test_hf_families.py's per family; TP2 × PP2 × VP2 of a Llama-style model is test_moe.py's (Mixtral at
# TP2×PP2×VP2×EP2).
@pytest.mark.parametrize("preset,world,layout", [
    ("tiny_gpt", 2, ["parallel.pipeline=2"]),
    pytest.param("tiny_gpt", 4, ["parallel.tensor=2", "parallel.pipeline=2"], marks=pytest.mark.full),
])
def test_export_from_any_layout_matches_megatron_logits(tmp_path, preset, world, layout):
    run_dir = tmp_path / "run"
    train(world, preset, run_dir, *layout)
    out = tmp_path / "hf"
    r = to_hf(run_dir, out)
    assert "to-hf:" in r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"tiny_llama": "LlamaForCausalLM", "tiny_gpt": "GPT2LMHeadModel"}[preset]]
    vocab = config["vocab_size"]
    assert vocab == {"tiny_llama": 32000, "tiny_gpt": 50257}[preset]  # padded to 50304 (TP1), 50432 (TP2)
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = megatron_logits(run_dir, tokens, tmp_path)
    got = hf_logits(out, tokens)
    diff = (got - ref).abs().max().item()
    print(f"{preset} {' '.join(layout)}: Megatron vs transformers logits max abs diff {diff:.3g}")
    assert got.shape == ref.shape and diff <= 1e-4
