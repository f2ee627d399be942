"""`python -m data_tools convert` failures are one line naming the file, exit status 1, nothing left behind:
a full disk under the output (to-hf and from-hf: real tmpfs mounts, skipped without root), a truncated
safetensors file, integer tensors where weights belong (never cast silently), and a `run_config.yaml`
carrying a Python tag (never constructed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_tools.convert import main
from pretrain.hf.hf_import import import_from_hf
from tests.data_tools.test_convert import random_llama


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pretrain.config import DataConfig
    from pretrain.hf.tokenizer import hf_tokenizer

    d = tmp_path_factory.mktemp("tok")
    hf_tokenizer(DataConfig()).save_pretrained(str(d))
    return d


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("[convert] error: "), err
    return err[0].removeprefix("[convert] error: ")


def test_disk_full_from_hf_and_to_hf(tmp_path, tokenizer_dir, tmpfs, capsys):
    src = random_llama(tmp_path / "hf", tokenizer_dir)  # 32000 x 64 embeddings alone: 8 MB
    full = tmpfs("full", "size=2m")
    assert main(["from-hf", "--hf", str(src), "--output", str(full / "ckpt"), "--no-progress"]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"{full}/ckpt: writing failed: No space left on device"), line
    assert line.endswith("; nothing was written there"), line
    assert list(full.iterdir()) == []  # no staging directory, no partial checkpoint

    ckpt = tmp_path / "ckpt"
    import_from_hf(src, ckpt, progress=False)
    assert main(["to-hf", "--checkpoint", str(ckpt), "--output", str(full / "hf"), "--no-progress"]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"{full}/hf: writing failed: No space left on device"), line
    assert list(full.iterdir()) == []


def test_truncated_safetensors_named(tmp_path, tokenizer_dir, capsys):
    src = random_llama(tmp_path / "hf", tokenizer_dir)
    f = sorted(src.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert main(["from-hf", "--hf", str(src), "--output", str(tmp_path / "ckpt"), "--no-progress"]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"{f}: not a readable safetensors file, truncated or corrupt ("), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_integer_weights_refused_not_cast(tmp_path, tokenizer_dir, capsys):
    from safetensors.torch import load_file, save_file

    src = random_llama(tmp_path / "hf", tokenizer_dir)
    for f in sorted(src.glob("*.safetensors")):
        weights = load_file(str(f))
        if "model.norm.weight" in weights:
            weights["model.norm.weight"] = weights["model.norm.weight"].round().to(torch.int64)
            save_file(weights, str(f), metadata={"format": "pt"})
            break
    assert main(["from-hf", "--hf", str(src), "--output", str(tmp_path / "ckpt"), "--no-progress"]) == 1
    assert _one_line(capsys) == (f"{f}: tensor 'model.norm.weight' is I64 (not floating point); refusing to cast "
                                 "model weights from an integer type")
    assert not (tmp_path / "ckpt").exists()


def test_run_config_with_python_tag_refused(tmp_path, tokenizer_dir, capsys):
    src = random_llama(tmp_path / "hf", tokenizer_dir)
    ckpt = tmp_path / "ckpt"
    import_from_hf(src, ckpt, progress=False)
    marker = tmp_path / "pwned"
    cfg = ckpt / "run_config.yaml"
    cfg.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    assert main(["to-hf", "--checkpoint", str(ckpt), "--output", str(tmp_path / "out"), "--no-progress"]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"{cfg}: not a plain YAML config (could not determine a constructor for the tag "
                           "'tag:yaml.org,2002:python/object/apply:os.system'"), line
    assert not marker.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------- hostile or inconsistent HF directories (issue 19)

def _tiny(directory: Path, **kw) -> Path:
    """A 512-token Llama without tokenizer files (a few hundred KB)."""
    from tests.data_tools.hf_random import write_random_hf
    from tests.data_tools.test_convert import llama_config

    write_random_hf(directory, llama_config(**{"vocab_size": 512, **kw}), seed=2)
    return directory


def _hf_cache(src: Path, cache: Path, repo: str = "models--acme--tiny") -> Path:
    """`src` laid out as huggingface_hub does: snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    import hashlib

    blobs, snap = cache / repo / "blobs", cache / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (blobs / digest).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    return snap


def test_import_without_tokenizer_from_hf_cache_and_export(tmp_path, capsys):
    """An HF cache snapshot (symlinks into blobs/) without tokenizer files, whose config.json names custom code:
    imported with notes and a train line asking for a tokenizer; its run config is refused by validate with both
    sizes (not an IndexError in training); to-hf writes weights + config.json only, with no auto_map."""
    import json

    from pretrain.__main__ import main as pretrain_main

    src = _tiny(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, architectures=["XForCausalLM"])
    (src / "config.json").write_text(json.dumps(cfg))
    snap = _hf_cache(src, tmp_path / "cache")
    ckpt = tmp_path / "ckpt"
    assert main(["from-hf", "--hf", str(snap), "--output", str(ckpt), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "auto_map (AutoModelForCausalLM) names custom code; it is not run" in err
    assert f"{snap} has no tokenizer files: the checkpoint records none" in err
    assert (f"train from it with: checkpoint.pretrained={ckpt} data.tokenizer_type=TYPE data.tokenizer_model=PATH "
            "(the model's tokenizer: at most 512 tokens") in out
    assert pretrain_main(["validate", str(ckpt / "run_config.yaml"), f"checkpoint.pretrained={ckpt}",
                          "data.mock=true"]) == 2
    assert "model.vocab_size=512 is smaller than the tokenizer's vocabulary of 32,000" in capsys.readouterr().err

    hf = tmp_path / "hf"
    assert main(["to-hf", "--checkpoint", str(ckpt), "--output", str(hf), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "exporting weights and config.json only" in err and "auto_map (custom code)" in err
    assert sorted(p.name for p in hf.iterdir()) == sorted(p.name for p in src.iterdir())
    from tests.data_tools.test_convert import safetensors_dir

    original, back = safetensors_dir(src), safetensors_dir(hf)
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)
    exported = json.loads((hf / "config.json").read_text())
    assert "auto_map" not in exported and exported["architectures"] == ["LlamaForCausalLM"]


def test_files_outside_the_hf_directory_are_refused(tmp_path, capsys):
    import json

    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET\n")
    cases = {}
    d = cases["symlinked asset"] = _tiny(tmp_path / "sym")
    (d / "vocab.txt").symlink_to(secret)
    d = cases["absolute index path"] = _tiny(tmp_path / "abs")
    shard = next(d.glob("*.safetensors"))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    moved = tmp_path / "elsewhere.safetensors"
    shard.rename(moved)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {**index, "weight_map": {k: str(moved) for k in index["weight_map"]}}))
    d = cases["../ index path"] = _tiny(tmp_path / "dots")
    next(d.glob("*.safetensors")).unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {**index, "weight_map": {k: "../elsewhere.safetensors" for k in index["weight_map"]}}))
    d = cases["another repository's blob"] = _hf_cache(_tiny(tmp_path / "c"), tmp_path / "cache")
    other = _hf_cache(_tiny(tmp_path / "o"), tmp_path / "cache", "models--evil--x")
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(Path("../../../models--evil--x/blobs") / (other / "config.json").resolve().name)
    expected = {"symlinked asset": f"{tmp_path}/sym/vocab.txt: resolves to {secret}, outside {tmp_path}/sym",
                "absolute index path": f"{tmp_path}/abs: names the absolute path {moved} (named by model.safetensors",
                "../ index path": f"{tmp_path}/dots/../elsewhere.safetensors: resolves to {moved}, outside",
                "another repository's blob": f"{d}/config.json: resolves to"}
    for name, src in cases.items():
        out = tmp_path / f"out_{name.replace(' ', '_')}"
        assert main(["from-hf", "--hf", str(src), "--output", str(out), "--no-progress"]) == 1, name
        line = _one_line(capsys)
        assert line.startswith(expected[name]), line
        assert not out.exists(), name


def test_hf_configs_that_do_not_fit_are_one_line(tmp_path, capsys):
    """Sizes transformers or our validation refuse, a tied model with a different lm_head, and a 3-expert model
    imported with parallel.expert=2: refused before anything is written (was: tracebacks, or a run_config.yaml
    its own validate refused)."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.data_tools.hf_random import write_random_hf
    from tests.data_tools.test_convert_moe import mixtral

    bad_heads = _tiny(tmp_path / "heads")
    negative = _tiny(tmp_path / "neg")
    for d, key, value in ((bad_heads, "num_attention_heads", 5), (negative, "vocab_size", -5)):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, key: value}))
    tied = _tiny(tmp_path / "tied", tie_word_embeddings=True)
    shard = next(tied.glob("*.safetensors"))
    weights = load_file(str(shard))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
    save_file(weights, str(shard), metadata={"format": "pt"})
    index = json.loads((tied / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    (tied / "model.safetensors.index.json").write_text(json.dumps(index))
    moe = tmp_path / "moe3"
    write_random_hf(moe, mixtral(vocab_size=512, num_local_experts=3))
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "acme_custom", "architectures": ["AcmeForCausalLM"],
                                                    "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}))
    cases = [(bad_heads, [], "config.json: The hidden size (64) is not a multiple of the number of attention heads"),
             (negative, [], "config.json: "),
             (tied, [], "config.json: tie_word_embeddings=true but the weights hold a 'lm_head.weight' that differs "
                        "from 'model.embed_tokens.weight'"),
             (moe, ["parallel.expert=2"], "config.json: the run config it makes does not validate (world size 2): "
                                          "[model.num_moe_experts, parallel.expert] model.num_moe_experts=3 is not "
                                          "divisible by parallel.expert=2"),
             (remote, [], "config.json: model_type 'acme_custom' (defined by custom code: auto_map, which is never "
                          "run) is not supported")]
    for src, overrides, message in cases:
        out = tmp_path / f"out_{src.name}"
        assert main(["from-hf", "--hf", str(src), "--output", str(out), "--no-progress", *overrides]) == 1
        line = _one_line(capsys)
        assert line.startswith(f"{src}/") and message in line, line
        assert not out.exists()
    for option, value, message in (("--max-shard-gb", "0", "--max-shard-gb 0.0: must be positive"),
                                   ("--iteration", "-1", "--iteration -1: must be at least 0")):
        assert main(["to-hf", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "x"), option, value]) == 1
        assert _one_line(capsys) == message


def test_export_of_a_tokenizerless_import_trained_with_the_null_tokenizer(tmp_path, capsys):
    """A model imported without tokenizer files and trained on mock data (the null tokenizer, which transformers has
    no equivalent of): to-hf without --tokenizer exports weights + config.json with a note, as the import was; a
    --tokenizer directory without tokenizer files is one line, exit 1, nothing written."""
    src = _tiny(tmp_path / "src")
    ckpt = tmp_path / "ckpt"
    assert main(["from-hf", "--hf", str(src), "--output", str(ckpt), "--no-progress"]) == 0
    run_config = ckpt / "run_config.yaml"  # what a run trained with data.mock=true records
    run_config.write_text(run_config.read_text().replace("tokenizer_type: sentencepiece",
                                                         "tokenizer_type: NullTokenizer"))
    capsys.readouterr()
    hf = tmp_path / "hf"
    assert main(["to-hf", "--checkpoint", str(ckpt), "--output", str(hf), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "without tokenizer files and the run's tokenizer cannot be written for transformers" in err, err
    assert sorted(p.name for p in hf.iterdir()) == sorted(p.name for p in src.iterdir())

    empty, partial = tmp_path / "empty", tmp_path / "partial"
    empty.mkdir()
    partial.mkdir()
    (partial / "tokenizer_config.json").write_text("{}")  # a tokenizer's settings without its vocabulary
    for given, line in ((empty, "no tokenizer files there (tokenizer.json, tokenizer.model, vocab.json + merges.txt, "
                                "...)"),
                        (partial, "transformers cannot load a tokenizer from it: Couldn't instantiate the backend")):
        out = tmp_path / f"hf_{given.name}"
        assert main(["to-hf", "--checkpoint", str(ckpt), "--output", str(out), "--tokenizer", str(given),
                     "--no-progress"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"[convert] error: --tokenizer {given}: {line}"), lines
        assert not out.exists()
