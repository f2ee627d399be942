"""Dry runs need no files: `data.mock=true` and nothing else validates every shipped config at the world size its
launch script uses, and every preset of every family; tokenizer types without an embedded tokenizer get a null
tokenizer of the model's vocabulary (one note), types with one keep it. The tiny configs train two steps that way,
and so does a null-tokenizer run; megatron-core's version stays the plain release (no `+<our commit>`).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from model_providers import FAMILIES, get_preset
from pretrain.__main__ import main
from pretrain.config import CONFIG_DIR, load_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
PRESETS = sorted(p for f in FAMILIES.values() for p in f.presets)


def documented_world_size(config: str) -> int:
    """Nodes x tasks per node of the launch script whose default CONFIG is `config`, else the "(world size N)" its
    header comment names, else 1."""
    for script in (REPO / "launch").glob("pretrain_*.sh"):
        text = script.read_text()
        if f"pretrain/configs/{config}.yaml" in text:
            nodes = re.search(r"^#SBATCH --nodes=(\d+)", text, re.M)
            tasks = re.search(r"^#SBATCH --ntasks-per-node=(\d+)", text, re.M)
            return int(nodes.group(1)) * int(tasks.group(1))
    stated = re.search(r"^#.*\(world size (\d+)\)", (CONFIG_DIR / f"{config}.yaml").read_text(), re.M)
    return int(stated.group(1)) if stated else 1


def _validate(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["validate", *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.out + captured.err


def _validate_here_or_on_gpus(capsys, *argv: str) -> tuple[int, str]:
    """`validate` on this machine; a model only Transformer Engine builds (nemotron3_super's LatentMoE) is refused
    here for that alone, and checked again as a GPU dry run (`--world-size 1`: the same checks on GPUs with TE)."""
    rc, text = _validate(capsys, *argv)
    problems = [line for line in text.splitlines() if re.match(r"\s+\d+\. ", line)]
    if rc == 2 and problems and all("with Transformer Engine only" in p for p in problems):
        rc, text = _validate(capsys, *argv, "--world-size", "1")
        assert "not on this machine (no CUDA, no Transformer Engine)" in text, text
    return rc, text


def _null_note(vocab: int) -> str:
    return f"a null tokenizer of {vocab:,} ids (EOD = {vocab - 1:,}, the last id; no files)"


def test_documented_world_sizes():
    assert {c: documented_world_size(c) for c in ("llama3_70b", "llama3_8b", "qwen3_30b_a3b", "tiny_llama",
                                                  "moonlight_16b_a3b", "deepseek_v3")} == {
        "llama3_70b": 64, "llama3_8b": 8, "qwen3_30b_a3b": 16, "tiny_llama": 2, "moonlight_16b_a3b": 16,
        "deepseek_v3": 256}


@pytest.mark.parametrize("config", SHIPPED)
def test_shipped_config_validates_with_mock_data_only(config, capsys, monkeypatch):
    """`--world-size N` on a machine without CUDA checks the job as on GPUs with Transformer Engine: every shipped
    config passes; what needs TE (deepseek_v3's MLA under CP, kimi_k2's QK-clip, gpt_oss_120b's moe_act recompute) is a
    note there, and refused for a job on this machine; nemotron3_super's LatentMoE likewise."""
    import torch

    from pretrain.validate import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    world = documented_world_size(config)
    rc, text = _validate(capsys, config, "data.mock=true", "--world-size", str(world))
    cfg = load_config(config, ["data.mock=true"])
    if any("data.blend" in str(stage.get("set", {})) for stage in cfg.stages or ()):
        # A run in stages whose stages name their own blends reads them with data.mock=true too (a given blend wins
        # over mock data): the only problems are those files and the tokenizer they need, none of the layout or model.
        problems = [line for line in text.splitlines() if re.match(r"\s+\d+\. ", line)]
        assert rc == 2 and problems and all(re.match(r"\s+\d+\. \[data\.(blend|tokenizer_type)", p)
                                            for p in problems), text
        return
    assert rc == 0 and "a GPU dry run" in text, text
    if cfg.data.tokenizer_type == "huggingface":  # the Llama-3 and Qwen3 configs: no tokenizer file needed
        assert f"training uses {_null_note(cfg.model.vocab_size)} from model.preset={cfg.model.preset}'s " \
               "model.vocab_size" in text, text
    here = validate(cfg, world, te_on_gpu=False, cuda_available=False)
    # What only GPUs with Transformer Engine run: deepseek_v3's MLA under CP, kimi_k2's QK-clip (the local attention
    # records no max logit). The dry run says each as a note; a job on this machine is refused.
    te_only = {"deepseek_v3": [("model.multi_latent_attention", "parallel.context")],
               "kimi_k2": [("optimizer.muon.qk_clip", "model.transformer_impl")],
               "gpt_oss_120b": [("model.recompute_modules", "model.moe_grouped_gemm")],  # moe_act: grouped GEMM
               "nemotron3_super": [("performance.moe_flex_dispatcher_backend",),  # HybridEP: DeepEP's build
                                   ("model.recompute_modules", "model.moe_grouped_gemm"),
                                   ("model.moe_latent_size", "model.transformer_impl")]}  # LatentMoE: TELinear
    if config in te_only:
        assert [e.keys for e in here.errors] == te_only[config], here.text()
        for keys in te_only[config]:
            assert f"note: not on this machine (no CUDA, no Transformer Engine): [{', '.join(keys)}]" in text, text
    else:  # llama3_8b's CP2 runs on CPU too (model_providers/core/cp_attention.py), and says so
        assert here.ok and "not on this machine" not in text, text
        assert (cfg.parallel.context > 1) == any("context parallelism without Transformer Engine" in n
                                                 for n in here.notes), here.notes


def test_every_preset_validates_with_mock_data(tmp_path, capsys):
    """A config naming only the preset: the default (SentencePiece) type uses the embedded tokenizer; with the
    huggingface type, a preset with a vocabulary gets a null tokenizer of it, one without is refused naming
    model.vocab_size."""
    for preset in PRESETS:
        path = tmp_path / f"{preset}.yaml"
        path.write_text(f"model:\n  preset: {preset}\n")
        rc, text = _validate_here_or_on_gpus(capsys, str(path), "data.mock=true")
        assert rc == 0, f"{preset}: {text}"
        rc, text = _validate_here_or_on_gpus(capsys, str(path), "data.mock=true", "data.tokenizer_type=huggingface")
        vocab = get_preset(preset).get("vocab_size")
        if vocab:
            assert rc == 0 and _null_note(vocab) in text, f"{preset}: {text}"
        else:
            assert rc == 2 and "uses a null tokenizer, which needs model.vocab_size (model.preset=" in text, text


def test_a_real_blend_still_needs_the_tokenizer(capsys):
    rc, text = _validate(capsys, "llama3_70b", "data.mock=true", "data.blend=[/data/web_text_document]",
                         "--world-size", "64")
    assert rc == 2 and "data.tokenizer_type=huggingface needs data.tokenizer_model" in text, text


@pytest.mark.slow
@pytest.mark.mcore
def test_tiny_configs_and_a_null_tokenizer_train_two_steps(tmp_path):
    """One process each, world 1: the tiny configs with data.mock=true and nothing else, and a huggingface-type run
    without files (null tokenizer of 1,000 ids: the first loss is near ln 1000, not ln 32000)."""
    from tests.pretrain.ckpt_helpers import metrics
    from tests.pretrain.cli_worker import run_cases

    cheap = ["train.steps=2", "train.global_batch_size=2", "train.micro_batch_size=2", "checkpoint.save_at_end=false",
             "logging.tensorboard=false"]  # one microbatch a step; nothing about the tokenizer
    cases = {name: ["train", name, "data.mock=true", *cheap, f"run.dir={tmp_path / name}"]
             for name in ("tiny_llama", "tiny_gpt", "tiny_moe")}
    null = ["train", "tiny_llama", "data.mock=true", "data.tokenizer_type=huggingface", "model.vocab_size=1000",
            *cheap, f"run.dir={tmp_path / 'null'}"]
    cases["null"] = [*null, "checkpoint.save_at_end=true"]  # saved, then resumed with the same null tokenizer
    cases["null_resumed"] = [*null, "train.steps=3"]
    results = run_cases(cases, tmp_path / "worker", timeout=900)
    resumed = results.pop("null_resumed")
    assert resumed["rc"] == 0, (resumed["stderr"][-3000:], resumed.get("traceback"))
    for name, result in results.items():
        assert result["rc"] == 0, (name, result["stderr"][-3000:], result.get("traceback"))
        losses = [r["loss"] for r in metrics(tmp_path / name) if "loss" in r][:2]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (name, losses)
    assert _null_note(1000) in results["null"]["stdout"], results["null"]["stdout"]
    null_losses = [r["loss"] for r in metrics(tmp_path / "null") if "loss" in r]
    assert len(null_losses) == 3 and abs(null_losses[0] - math.log(1000)) < 1.0, null_losses  # 2 steps + 1 resumed
    config = json.loads(json.dumps(load_config(str(tmp_path / "null" / "config.yaml")).to_dict()))
    assert config["data"]["tokenizer_model"] is None  # what the user wrote; the note says what was used


@pytest.mark.mcore
def test_megatron_core_version_is_the_plain_release(tmp_path):
    """Without NO_VCS_VERSION in the environment, our entry points keep megatron-core's package_info from
    appending our checkout's commit: its __version__ and the versions note are the release in its metadata."""
    env = {k: v for k, v in os.environ.items() if k != "NO_VCS_VERSION"}
    env["PYTHONPATH"] = str(REPO)
    release = metadata.version("megatron-core")
    probe = "import pretrain, megatron.core as m; print(m.__version__)"
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == release, done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "pretrain", "validate", "tiny_llama"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (note,) = [ln for ln in done.stdout.splitlines() if "note: versions:" in ln]
    assert f", megatron-core {release}, " in note and "+" not in note.split("megatron-core ")[1].split(",")[0], note
