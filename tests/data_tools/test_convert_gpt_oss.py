"""GPT-OSS through the HF bridge, beyond what test_hf_families.py proves for it as for every family (the released-style
random `GptOssForCausalLM` of hf_families.py: windowed then full layers with the window 16 shorter than the training
length 64, sinks, biases, 4 experts with the clamped SwiGLU acting, YaRN; HF → ours → HF bit-identical, lr-0 training
at TP2 and EP2 = transformers' loss, the trained export = Megatron's logits): a checkpoint whose expert weights are
stored as MXFP4 (`*_blocks`/`*_scales`, written here by an encoder of our own) imports equal to the import of its
dequantized weights, says so in one line and records it, and exports unquantized weights, saying so; the
dequantization equals a hand-computed block and transformers' own; config fields it cannot run are refused in one
line naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_tools.convert import main
from pretrain.hf.mxfp4 import BLOCK, E2M1, SCALE_BIAS, dequantize

from .hf_families import CONFIGS, safetensors_dir, tokenizer_files, write_hf_model

SEQ = 64  # the training length: four times GPT-OSS's window here (16)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def convert(*args: str) -> None:
    assert main([*args, "--no-progress"]) == 0, args


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    """The released-style HF model directory."""
    root = tmp_path_factory.mktemp("gpt_oss")
    return write_hf_model("gpt_oss", root / "hf", {"bpe": tokenizer_files("bpe", root / "bpe")})


# --------------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------------

def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own MXFP4 encoder (the tests' writer of released-style checkpoints): `w` [..., rows, in] → blocks
    [..., rows, in / 32, 16] and scales [..., rows, in / 32]; each group's scale is the power of two that puts its
    largest magnitude in [4, 8), each value rounded to the nearest E2M1 code."""
    groups = w.reshape(*w.shape[:-1], -1, BLOCK).float()
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -100)
    exponent = torch.floor(torch.log2(amax)) - 2  # amax / 2^e in [4, 8)
    codes_values = torch.tensor(E2M1)
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - codes_values).abs().argmin(-1).to(torch.uint8)  # [..., groups, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def test_dequantize_a_hand_computed_block_and_as_transformers_does():
    # One group: bytes 0x21 (0.5, 1.0), 0xF8 (-0.0, -6.0), 0x7E (-4.0, 6.0), the rest 0; scale 2^(125-127) = 1/4.
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, :3] = torch.tensor([0x21, 0xF8, 0x7E], dtype=torch.uint8)
    values = dequantize(blocks, torch.tensor([[125]], dtype=torch.uint8), torch.float32)
    assert values.shape == (1, 32)
    assert values[0, :6].tolist() == [0.125, 0.25, -0.0, -1.5, -1.0, 1.5] and not values[0, 6:].any()

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 8, 4), dtype=torch.uint8, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize(blocks, scales, dtype).transpose(1, 2)  # GPT-OSS's experts: [experts, in, out]
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    w = torch.randn(3, 8, 128, generator=gen)
    assert torch.equal(dequantize(*encode_mxfp4(dequantize(*encode_mxfp4(w), torch.float32)), torch.float32),
                       dequantize(*encode_mxfp4(w), torch.float32))  # encode ∘ decode is the identity on MXFP4 values


def _quantized_copy(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """`src` with its expert weights stored as MXFP4 (config.json naming it, as openai/gpt-oss does); returns the
    dequantized expert weights ([experts, in, out], fp32) that the MXFP4 bytes hold."""
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"],
                                     "quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors, held = {}, {}
    for name, t in safetensors_dir(src).items():
        if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
            blocks, scales = encode_mxfp4(t.transpose(1, 2))  # stored [experts, out, in]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            held[name] = dequantize(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        else:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return held


def test_mxfp4_checkpoint_imports_dequantized_and_exports_unquantized(tmp_path, gpt_oss, capsys):
    from safetensors.torch import save_file

    from pretrain.hf.readers import CheckpointReader

    src = gpt_oss
    held = _quantized_copy(src, tmp_path / "mxfp4")
    # The reference: the same model with the dequantized values stored plainly (fp32, as the rest of the model).
    reference = tmp_path / "dequantized"
    reference.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (reference / f.name).write_bytes(f.read_bytes())
    save_file({**safetensors_dir(src), **held}, str(reference / "model.safetensors"), metadata={"format": "pt"})

    capsys.readouterr()
    convert("from-hf", "--hf", str(tmp_path / "mxfp4"), "--output", str(tmp_path / "ckpt"), f"model.seq_length={SEQ}")
    notes = [line for line in capsys.readouterr().err.splitlines() if "MXFP4" in line]
    assert notes == ["[convert] note: 4 MXFP4 tensors (model.layers.*.mlp.experts.{down_proj,gate_up_proj}, stored "
                     "as *_blocks/*_scales) dequantized to float32 (exact: bf16 and fp32 hold every MXFP4 value); the "
                     "checkpoint holds them unquantized (recorded in hf_import.json)"], notes
    record = json.loads((tmp_path / "ckpt" / "hf_import.json").read_text())["dequantized"]
    assert record["format"] == "mxfp4" and record["dtype"] == "float32" and record["tensors"] == 4
    convert("from-hf", "--hf", str(reference), "--output", str(tmp_path / "ckpt_ref"), f"model.seq_length={SEQ}")
    ours, ref = CheckpointReader(tmp_path / "ckpt"), CheckpointReader(tmp_path / "ckpt_ref")
    assert sorted(ours.tensors) == sorted(ref.tensors)
    for key in ref.tensors:
        assert torch.equal(ours.read(key), ref.read(key)), key
    assert not torch.equal(held["model.layers.0.mlp.experts.down_proj"],
                           safetensors_dir(src)["model.layers.0.mlp.experts.down_proj"])  # it was quantized

    # bf16 on request: the same values (exact in bf16).
    convert("from-hf", "--hf", str(tmp_path / "mxfp4"), "--output", str(tmp_path / "ckpt_bf16"), "--dtype", "bf16",
            f"model.seq_length={SEQ}")
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    bf16 = CheckpointReader(tmp_path / "ckpt_bf16").read(fc1)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.float(), ours.read(fc1))

    # to-hf: the dequantized weights, no quantization_config, one line saying so, recorded in the index.
    capsys.readouterr()
    convert("to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "back"))
    err = [line for line in capsys.readouterr().err.splitlines() if "quantiz" in line]
    assert err == ["[convert] note: the imported model stored weights as mxfp4; this export writes every weight "
                   "unquantized (float32) and its config.json has no quantization_config (recorded in "
                   "model.safetensors.index.json)"], err
    exported, want = safetensors_dir(tmp_path / "back"), safetensors_dir(reference)
    assert sorted(exported) == sorted(want) and all(torch.equal(exported[k], want[k]) for k in want)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config and config == {k: v for k, v in json.loads(
        (tmp_path / "mxfp4" / "config.json").read_text()).items() if k != "quantization_config"}
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["dequantized_from"] == "mxfp4" and index["metadata"]["dtype"] == "float32"


BAD = {
    "swiglu_alpha": ({"swiglu_alpha": 1.5}, "config.json: swiglu_alpha=1.5 is not supported (Megatron-Core's "
                     "quick_gelu has the fixed gain 1.702)"),
    "attention_bias": ({"attention_bias": False}, "config.json: attention_bias=False is not supported"),
    "rope type": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                  "config.json: rope_scaling type 'linear' is not supported (GPT-OSS: yarn)"),
    "quantization": ({"quantization_config": {"quant_method": "fp8"}},
                     "config.json: quantization_config.quant_method='fp8' is not supported"),
}


def test_unsupported_config_fields_are_one_line_naming_them(tmp_path, gpt_oss, capsys):
    src = gpt_oss
    for case, (changes, message) in BAD.items():
        bad = tmp_path / case.replace(" ", "_")
        bad.mkdir()
        for f in src.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "config.json").write_text(json.dumps({**CONFIGS["gpt_oss"], **changes}))
        capsys.readouterr()
        assert main(["from-hf", "--hf", str(bad), "--output", str(tmp_path / "out" / case), "--no-progress"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[convert] error: ") and message in err[0], (case, err)
