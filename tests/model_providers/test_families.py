"""Model families: the registry finds every family module, each family's HF config goes both ways, and
adding a family is adding one file (shown end to end through `python -m pretrain validate`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_providers
from model_providers import FAMILIES, all_presets, family_for_hf, get_family
from model_providers.core.mapping import ConversionError
from pretrain.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_registry_holds_every_family_module_and_unique_presets():
    modules = sorted(p.stem for p in Path(model_providers.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    assert sorted(FAMILIES) == modules  # every top-level module is a family
    presets = all_presets()
    for family in FAMILIES.values():
        for name, fields in family.presets.items():
            assert presets[name] is fields and fields["family"] == family.name
            for key, value in family.fixed_fields.items():
                assert fields[key] == value, (name, key)


def test_llama31_config_has_llama3_rope_scaling(tmp_path):
    from transformers import AutoConfig

    m = load_config(None, ["model.preset=llama31_8b"]).model
    llama = get_family("llama")
    cfg = llama.to_hf_config(m, 128256, bos=128000, eos=128001, dtype=torch.bfloat16)
    text = llama.config_json(cfg)
    assert text["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert text["rope_theta"] == 500000.0 and text["num_key_value_heads"] == 8 and text["architectures"] == [
        "LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(text))
    loaded = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.rope_parameters["rope_type"] == "llama3" and loaded.rope_parameters["factor"] == 8.0
    assert family_for_hf(loaded) is llama
    fields = llama.from_hf_config(loaded)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "rotary_base", "rope_scaling", "rope_scaling_factor"):
        assert fields[key] == getattr(m, key), key


def test_unsupported_model_config_names_the_field():
    m = load_config(None, ["model.preset=tiny_llama", "model.add_qkv_bias=true"]).model
    with pytest.raises(ConversionError, match="add_qkv_bias"):
        get_family("llama").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)


def test_unknown_hf_model_type_is_refused():
    from transformers import MambaConfig

    with pytest.raises(ConversionError, match=r"model_type 'mamba' .* is not supported"):
        family_for_hf(MambaConfig())


TOY_FAMILY = '''
"""A toy family: a Llama under another name, to show that a family is one file."""
from model_providers.llama import FAMILY as _LLAMA, LlamaFamily

FAMILY = LlamaFamily(name="toy", hf_architecture="ToyForCausalLM", hf_model_type="toy",
                     presets={"toy_tiny": {**_LLAMA.presets["tiny_llama"], "family": "toy"}},
                     mapping=_LLAMA.mapping, fixed_fields=_LLAMA.fixed_fields)
'''


def test_a_new_family_is_one_new_file(tmp_path):
    """Copy the package, add one file, and the config, validator and trainer's model builder know the family."""
    shutil.copytree(ROOT / "model_providers", tmp_path / "model_providers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "model_providers" / "toy.py").write_text(TOY_FAMILY)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pretrain", "validate", "tiny_llama", "model.preset=toy_tiny",
                           "--world-size", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "config OK" in proc.stdout, proc.stdout + proc.stderr
    bad = subprocess.run([sys.executable, "-m", "pretrain", "validate", "tiny_llama", "model.family=nope"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "model.family='nope' is not one of " in bad.stderr and ", toy" in bad.stderr
