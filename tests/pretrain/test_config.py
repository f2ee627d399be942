"""Config tree: YAML + dotted overrides parsed as YAML, presets, and clear errors for bad input."""

from __future__ import annotations

import pytest

from pretrain.config import CONFIG_DIR, Config, ConfigError, load_config, parse_override
from tests.cli import run_cli

REPO = CONFIG_DIR.parent.parent


def test_every_shipped_config_loads():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert {"tiny_llama", "tiny_gpt", "llama3_8b", "llama3_70b"} <= set(names)
    for name in names:
        assert isinstance(load_config(name), Config)


def test_tiny_llama_shape_matches_the_issue():
    m = load_config("tiny_llama").model
    assert (m.num_layers, m.normalization, m.gated_linear_unit, m.activation) == (4, "RMSNorm", True, "silu")
    assert m.num_query_groups < m.num_attention_heads  # GQA
    assert m.position_embedding_type == "rope" and not m.share_embeddings_and_output_weights
    assert m.hidden_dropout == 0.0 and m.attention_dropout == 0.0
    g = load_config("tiny_gpt").model
    assert (g.normalization, g.activation, g.share_embeddings_and_output_weights) == ("LayerNorm", "gelu", True)


def test_llama3_presets_match_public_shapes():
    m8, m70 = load_config("llama3_8b").model, load_config("llama3_70b").model
    assert (m8.num_layers, m8.hidden_size, m8.ffn_hidden_size, m8.num_attention_heads, m8.num_query_groups) == (
        32, 4096, 14336, 32, 8)
    assert (m70.num_layers, m70.hidden_size, m70.ffn_hidden_size, m70.num_attention_heads) == (80, 8192, 28672, 64)
    assert m8.rotary_base == 500000.0 and m8.vocab_size == 128256
    m405 = load_config(None, ["model.preset=llama31_405b"]).model
    assert (m405.num_layers, m405.hidden_size, m405.rope_scaling) == (126, 16384, True)


def test_overrides_are_yaml_and_beat_the_file_and_the_preset():
    cfg = load_config("tiny_llama", ["parallel.tensor=2", "data.blend=[1.0,/data/x_text_document]",
                                     "model.hidden_size=64", "optimizer.lr=3e-4", "parallel.virtual_pipeline=null"])
    assert cfg.parallel.tensor == 2
    assert cfg.data.blend == [1.0, "/data/x_text_document"]
    assert cfg.model.hidden_size == 64 and cfg.model.num_layers == 4  # preset fills the rest
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.parallel.virtual_pipeline is None
    assert parse_override("train.steps=10") == ("train.steps", 10)


@pytest.mark.parametrize("override,message", [
    ("parallel.tensr=2", "unknown config key 'parallel.tensr' (did you mean 'parallel.tensor'?)"),
    ("parallel.tensor=two", "'parallel.tensor' must be of type int, got 'two' (str)"),
    ("train.steps=1.5", "'train.steps' must be of type int, got 1.5 (float)"),
    ("parallel.sequence_parallel=maybe", "'parallel.sequence_parallel' must be of type bool, got 'maybe' (str)"),
    ("model.preset=llama9_1t", "unknown model.preset 'llama9_1t'"),
    ("trainsteps", "override 'trainsteps' must look like section.key=value"),
    ("data.blend=[1.0,", "override 'data.blend=[1.0,': value is not valid YAML"),
    # Enum-like fields are checked when the config is parsed (the validator keeps the cross-field rules).
    ("model.fp8=fp4", "model.fp8='fp4' is not one of tensorwise, delayed, mxfp8, blockwise (or null)"),
    ("train.precision=fp8", "train.precision='fp8' is not one of auto, bf16, fp16, fp32"),
    ("train.nan_policy=ignore", "train.nan_policy='ignore' is not one of stop, skip"),
    ("optimizer.decay_style=exp", "optimizer.decay_style='exp' is not one of cosine, linear, constant, WSD, "
                                  "inverse-square-root"),
    ("model.recompute_granularity=some", "model.recompute_granularity='some' is not one of selective, full (or null)"),
    ("model.family=mamba", "model.family='mamba' is not one of "),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_llama", [override])
    assert message in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file 'nope.yaml' not found"):
        load_config("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("llama3_70b", ["train.steps=7"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_cli_config_error_exits_2():
    proc = run_cli("pretrain", ["validate", "tiny_llama", "parallel.tensr=2"], cwd=REPO)
    assert proc.rc == 2
    assert "unknown config key 'parallel.tensr' (did you mean 'parallel.tensor'?)" in proc.stderr
