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
