"""Every HF family both ways through `python -m data_tools convert` and the trainer: a released-style model
(tiny, random weights, GQA, tokenizer files) → from-hf → to-hf is the same model directory (weights bit-identical,
config.json, tokenizer and generation files byte-equal); training from it at TP2 and at PP2 with lr 0 reproduces
transformers' loss at every step; the export of a trained run loads in AutoModelForCausalLM, gives Megatron's
logits and generates; bad input is refused with one line naming the field and leaves nothing behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from data_tools.convert import main
from pretrain.hf.assets import ASSET_DIR
from tests import tiers
from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text

from .hf_families import (
    CONFIGS,
    FAMILIES,
    SEQ_LENGTH,
    TOKENIZER,
    hf_model,
    hf_mtp,
    hf_mtp_loss,
    non_weight_files,
    safetensors_dir,
    tokenizer_files,
    write_hf_model,
)

pytestmark = pytest.mark.mcore  # the HF bridge and the trainer for every family (CI: also on megatron-core 0.19.2)

# Every family at TP2 vs transformers and exported in `make test`; at PP2 too in `make test-all`, DeepSeek-V3 (its
# stages split 1 | 2, the MTP layer on the last stage) in both.
PP2_FAMILIES = ("deepseek_v3",)
# Families also run at EP2 (world 2: EP2 × DP2) vs transformers in the same pool case, in `make test`.
EP2_FAMILIES = ("gpt_oss", "qwen3_next", "nemotron_h")
# Families also run at TP1 (world 2: DP2) vs transformers in the same pool case, in `make test`.
TP1_FAMILIES = ("nemotron_h",)
# Extra layout keys per family: GPT-OSS's expert biases need expert tensor parallelism 1 under TP.
LAYOUT_KEYS = {"gpt_oss": ["parallel.expert_tensor=1"]}
# Trained (lr 1e-3) at TP2, exported, transformers' logits = Megatron's: in `make test` a dense family with tied
# embeddings and the MoE + MLA + MTP one (the export reads the run's own, updated weights: family-independent); every
# family in `make test-all`. The others' export is checked on their lr-0 TP2 runs (bit-identical to the import, and
# transformers' logits of it = Megatron's).
TRAINED_FAMILIES = ("llama", "deepseek_v3")


def convert(*args: str) -> None:
    assert main([*args, "--no-progress"]) == 0, args


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: tokenizer_files(kind, root / kind) for kind in ("sentencepiece", "bpe")}


@pytest.fixture(scope="module")
def imported(tmp_path_factory, tokenizers) -> dict[str, tuple[Path, Path]]:
    """family → (HF model directory, checkpoint imported from it at TP1 with the family's training length)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        src = write_hf_model(family, root / f"hf_{family}", tokenizers)
        ckpt = root / f"ckpt_{family}"
        convert("from-hf", "--hf", str(src), "--output", str(ckpt), f"model.seq_length={SEQ_LENGTH[family]}")
        out[family] = (src, ckpt)
    return out


@pytest.fixture(scope="module")
def embedded_corpus_by_tokenizer(tmp_path_factory):
    """A function (tokenizer kind, tokenizer dir) → the embedded corpus preprocessed with it (made once per kind)."""
    from data_tools.preprocess import preprocess

    from .conftest import corpus_texts, write_jsonl

    root = tmp_path_factory.mktemp("corpus")
    corpus = write_jsonl(root / "corpus.jsonl", corpus_texts())
    made: dict[str, str] = {}

    def prefix(kind: str, tokenizer_dir: Path) -> str:
        if kind not in made:
            preprocess([str(corpus)], str(root / kind), "huggingface", str(tokenizer_dir), append_eod=True, workers=1)
            made[kind] = f"{root / kind}_text_document"
        return made[kind]

    return prefix


def assert_same_model_directory(exported: Path, original: Path) -> None:
    """Weights bit-identical (names, dtypes, values) and every other file byte-equal."""
    ours, theirs = safetensors_dir(exported), safetensors_dir(original)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    files, want = non_weight_files(exported), non_weight_files(original)
    assert sorted(files) == sorted(want)
    for name, data in want.items():
        assert files[name] == data, name


# --------------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_gives_the_same_model_directory(tmp_path, imported, family):
    src, ckpt = imported[family]
    assert sorted(p.name for p in (ckpt / ASSET_DIR).iterdir()) == sorted(non_weight_files(src))
    convert("to-hf", "--checkpoint", str(ckpt), "--output", str(tmp_path / "back"))
    assert_same_model_directory(tmp_path / "back", src)

    # Another dtype: the weights are cast, config.json changes in its dtype and nothing else.
    convert("to-hf", "--checkpoint", str(ckpt), "--output", str(tmp_path / "bf16"), "--dtype", "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config == {**CONFIGS[family], "torch_dtype": "bfloat16"}
    original = safetensors_dir(src)
    for name, t in safetensors_dir(tmp_path / "bf16").items():
        kept = name.endswith("e_score_correction_bias")  # DeepSeek's expert bias keeps its fp32 (ExactCopy)
        want = original[name] if kept else original[name].to(torch.bfloat16)
        assert t.dtype == want.dtype and torch.equal(t, want), name


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_the_model_fields_alone_means_the_same(tmp_path, imported, family):
    """Without the imported config.json, the one generated from the model fields is read by transformers as the
    original in every key but the ones no model field decides (token ids, initializer range, unknown keys)."""
    from transformers import AutoConfig

    src, ckpt = imported[family]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    (copy / ASSET_DIR / "config.json").unlink()
    convert("to-hf", "--checkpoint", str(copy), "--output", str(tmp_path / "hf"))
    ours = AutoConfig.from_pretrained(str(tmp_path / "hf"), local_files_only=True).to_dict()
    theirs = AutoConfig.from_pretrained(str(src), local_files_only=True).to_dict()
    differ = {k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)}
    # ep_size: DeepSeek's inference-time expert parallel size (no model field decides it); experts_per_token,
    # initial_context_length: released GPT-OSS keys transformers does not read; pad_token_id: a token id;
    # use_sliding_window: a released Qwen3-Next key its class does not have; norm_eps, rope_theta,
    # partial_rotary_factor: released Nemotron-H keys transformers does not read (it has no RoPE).
    assert differ <= {"_name_or_path", "bos_token_id", "eos_token_id", "max_window_layers", "use_mrope", "ep_size",
                      "experts_per_token", "initial_context_length", "pad_token_id", "use_sliding_window", "norm_eps",
                      "rope_theta", "partial_rotary_factor"}, differ


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

def _edit_config(src: Path, **changes) -> None:
    config = {**json.loads((src / "config.json").read_text()), **changes}
    (src / "config.json").write_text(json.dumps(config))


def _edit_weights(src: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    for f in src.glob("*.safetensors"):
        save_file(edit(load_file(str(f))), str(f))


BAD = {
    "unsupported architecture": ("llama", lambda s: _edit_config(s, model_type="gemma", architectures=[
        "GemmaForCausalLM"]), "config.json: model_type 'gemma' (GemmaForCausalLM) is not supported"),
    "unsupported rope type": ("llama", lambda s: _edit_config(s, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
        "config.json: rope_scaling type 'yarn' is not supported (supported: default, llama3)"),
    "qwen3 output bias": ("qwen3", lambda s: _edit_config(s, attention_bias=True),
                          "config.json: attention_bias=true (biases on q/k/v/o_proj) is not supported"),
    "missing tensor": ("qwen2", lambda s: _edit_weights(s, lambda w: {
        k: v for k, v in w.items() if k != "model.layers.1.self_attn.k_proj.bias"}),
        "HF tensor 'model.layers.1.self_attn.k_proj.bias' is missing"),
    "extra tensor": ("qwen2", lambda s: _edit_weights(s, lambda w: {
        **w, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
        "HF tensor 'model.layers.0.self_attn.q_norm.weight' is not in the qwen2 HF mapping"),
    "qwen3_next dedicated MTP embeddings": ("qwen3_next", lambda s: _edit_config(
        s, mtp_use_dedicated_embeddings=True), "config.json: mtp_use_dedicated_embeddings=True is not supported"),
    "qwen3_next rope type": ("qwen3_next", lambda s: _edit_config(s, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
        "config.json: rope_parameters="),
    "nemotron_h dt limit": ("nemotron_h", lambda s: _edit_config(s, time_step_limit=[0.0, 0.1]),
                            "config.json: time_step_limit=[0.0, 0.1] is not supported (Megatron-Core's training scan "
                            "clamps no time step)"),
    "nemotron_h latent MoE on CPU": ("nemotron_h", lambda s: _edit_config(s, moe_latent_size=32),
                                     "[model.moe_latent_size, model.transformer_impl] LatentMoE "
                                     "(model.moe_latent_size): Megatron-Core builds its latent projections with "
                                     "Transformer Engine only"),
    "nemotron_h MTP": ("nemotron_h", lambda s: _edit_config(s, num_nextn_predict_layers=1),
                       "config.json: num_nextn_predict_layers=1 is not supported (transformers' NemotronH builds no "
                       "MTP layer (it drops mtp.* weights on load), so the bridge maps none"),
    "wrong shape": ("qwen3", lambda s: _edit_weights(s, lambda w: {
        **w, "model.layers.0.self_attn.k_norm.weight": torch.ones(16)}),
        "HF tensor 'model.layers.0.self_attn.k_norm.weight' has shape [16]; config.json implies [32]"),
}


def test_bad_input_is_one_line_naming_the_field(tmp_path, tokenizers, capsys):
    for case, (family, edit, message) in BAD.items():
        src = write_hf_model(family, tmp_path / f"hf_{family}_{len(list(tmp_path.iterdir()))}", tokenizers)
        if edit is not None:
            edit(src)
        out = tmp_path / "out" / "ckpt"
        capsys.readouterr()
        assert main(["from-hf", "--hf", str(src), "--output", str(out), "--no-progress"]) == 1, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[convert] error: ") and message in err[0], (case, err)
        assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir())), case


# --------------------------------------------------------------------------------------------------
# Continued pretraining at TP2 and PP2, export of a trained run
# --------------------------------------------------------------------------------------------------


def _hf_step_losses(src: Path, cfg, steps: int) -> tuple[list[float], list[float] | None]:
    """transformers' loss on each global batch the trainer reads (the run's own dataset and tokenizer), and the
    MTP loss of transformers' MTP module for a model with MTP layers (else None)."""
    from torch.nn.functional import cross_entropy

    from pretrain.data.datasets import build_datasets
    from pretrain.data.plan import data_plan
    from pretrain.tokenizer.load import run_tokenizer

    t = cfg.train
    train, _ = build_datasets(data_plan(cfg), run_tokenizer(cfg.data), steps * t.global_batch_size)
    model = hf_model(src)
    mtp = hf_mtp(src, model) if getattr(model.config, "num_mtp_layers", 0) else None
    losses, mtp_losses = [], []
    for step in range(steps):
        samples = [train[step * t.global_batch_size + i] for i in range(t.global_batch_size)]
        tokens, labels, mask = (torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask"))
        with torch.no_grad():
            hidden = model.model(tokens).last_hidden_state
            logits = model.lm_head(hidden)
        per_token = cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        losses.append((per_token * mask.reshape(-1).float()).sum().item() / mask.float().sum().item())
        if mtp is not None:
            mtp_losses.append(hf_mtp_loss(mtp, hidden, tokens, labels, mask))
    return losses, (mtp_losses if mtp is not None else None)


def _step_losses(run_dir: Path, key: str = "loss") -> list[float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in sorted((r for r in records if "loss" in r), key=lambda r: r["step"])]


@pytest.mark.slow
def test_continued_pretraining_matches_transformers_and_exports(tmp_path, imported, embedded_corpus_by_tokenizer):
    from pretrain.config import load_config

    steps = 2
    common = [f"train.steps={steps}", "train.global_batch_size=4", "train.micro_batch_size=2", "optimizer.min_lr=0",
              "optimizer.warmup_steps=0", "logging.tensorboard=false", f"data.cache_dir={tmp_path / 'cache'}"]
    # TP2 with sequence parallelism (MoE layers need it with TP; the dense families run the same at TP2).
    tp2 = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
    layouts = {"tp1": ["optimizer.lr=0"], "tp2": [*tp2, "optimizer.lr=0"],
               "pp2": ["parallel.pipeline=2", "optimizer.lr=0"], "ep2": ["parallel.expert=2", "optimizer.lr=0"],
               "trained": [*tp2, "optimizer.lr=1e-3"]}
    jobs, runs = [], {}
    for family in FAMILIES:
        src, ckpt = imported[family]
        prefix = embedded_corpus_by_tokenizer(TOKENIZER[family], ckpt / ASSET_DIR)
        for name, layout in layouts.items():
            if name == "pp2" and family not in PP2_FAMILIES and not tiers.everything():
                continue
            if name == "ep2" and family not in EP2_FAMILIES or name == "tp1" and family not in TP1_FAMILIES:
                continue
            layout = [*layout, *LAYOUT_KEYS.get(family, [])]
            if name == "trained" and family not in TRAINED_FAMILIES and not tiers.everything():
                continue
            # DeepSeek's 3 layers at PP2: 1 | 2 (+ MTP), so stage 0 holds no MoE layer.
            if name == "pp2" and CONFIGS[family]["num_hidden_layers"] % 2:
                layout = [*layout, "parallel.num_layers_in_first_pipeline_stage=1"]
            # Megatron moves the aux-loss-free expert bias after every step whatever the lr; transformers' reference
            # keeps e_score_correction_bias fixed, so the lr-0 runs hold it still too.
            if name != "trained" and family in ("deepseek_v3", "nemotron_h"):
                layout = [*layout, "model.moe_router_bias_update_rate=0"]
            run_dir = tmp_path / f"{family}_{name}"
            overrides = [f"run.dir={run_dir}", f"checkpoint.pretrained={ckpt}", f"data.blend=[{prefix}]", *common,
                         *layout]
            jobs.append([str(ckpt / "run_config.yaml"), overrides])
            runs[family, name] = (run_dir, overrides)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc = run_case(2, "tests.data_tools.train_worker", [str(tmp_path / "jobs.json")], tmp_path / "train.log",
                  timeout=900, env={"PYTHONWARNINGS": "ignore"})
    assert rc == 0, log_text(tmp_path / "train.log")[-6000:]

    report = {}
    for family in FAMILIES:
        src, ckpt = imported[family]
        run_dir, overrides = runs[family, "tp2"]
        hf, hf_mtp_losses = _hf_step_losses(src, load_config(ckpt / "run_config.yaml", overrides), steps)
        for name in ("tp1", "tp2", "pp2", "ep2"):
            if (family, name) not in runs:
                continue
            got = _step_losses(runs[family, name][0])
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, hf))
            report[family, name] = rel
            print(f"{family} {name}: losses {got} vs transformers {hf}: max relative diff {rel:.2e}")
            assert len(got) == steps and rel <= 1e-5, (family, name, got, hf)
            if hf_mtp_losses is not None:  # Megatron's MTP layer (PP2: on the last stage) = transformers' MTP module
                got = _step_losses(runs[family, name][0], "mtp_loss")
                rel = max(abs(a - b) / abs(b) for a, b in zip(got, hf_mtp_losses))
                print(f"{family} {name}: MTP losses {got} vs transformers {hf_mtp_losses}: max relative diff {rel:.2e}")
                assert rel <= 1e-5, (family, name, got, hf_mtp_losses)
        # lr 0 at TP2 (vocabulary padded for TP2, imported at TP1): the export is the imported model again.
        convert("to-hf", "--checkpoint", str(run_dir), "--output", str(tmp_path / f"{family}_tp2_hf"))
        assert_same_model_directory(tmp_path / f"{family}_tp2_hf", src)

    # The trained runs (lr 1e-3, TP2; the lr-0 TP2 run's export for the families without one in this tier):
    # transformers loads the export and gives the Megatron model's logits.
    args, tokens, exports = [], {}, {}
    for family in FAMILIES:
        trained = (family, "trained") in runs
        source = runs[family, "trained" if trained else "tp2"][0]
        exports[family] = (tmp_path / f"{family}_hf") if trained else (tmp_path / f"{family}_tp2_hf")
        tokens[family] = torch.randint(0, CONFIGS[family]["vocab_size"], (2, SEQ_LENGTH[family]),
                                       generator=torch.Generator().manual_seed(3))
        torch.save(tokens[family], tmp_path / f"{family}_tokens.pt")
        args += [str(source), str(tmp_path / f"{family}_tokens.pt"), str(tmp_path / f"{family}_logits.pt")]
        if trained:
            convert("to-hf", "--checkpoint", str(source), "--output", str(exports[family]))
    rc = run_case(1, "tests.data_tools.convert_worker", ["logits", *args], tmp_path / "logits.log", timeout=600,
                  env={"PYTHONWARNINGS": "ignore"})
    assert rc == 0, log_text(tmp_path / "logits.log")[-3000:]
    for family in FAMILIES:
        exported = exports[family]
        if (family, "trained") in runs:
            assert not torch.equal(safetensors_dir(exported)["model.norm.weight"],
                                   safetensors_dir(imported[family][0])["model.norm.weight"])  # it did train
        model = hf_model(exported)
        with torch.no_grad():
            got = model(tokens[family]).logits
        ref = torch.load(tmp_path / f"{family}_logits.pt", weights_only=True)
        diff = (got - ref).abs().max().item()
        report[family, "export"] = diff
        what = "trained" if (family, "trained") in runs else "lr 0"
        print(f"{family} {what} at TP2 → to-hf: transformers vs Megatron logits max abs diff {diff:.2e}")
        assert got.shape == ref.shape and diff <= 1e-4, family
        generated = model.generate(tokens[family][:1, :8], max_new_tokens=4, do_sample=False)
        assert generated.shape == (1, 12)
    print("family | loss TP1 | loss TP2 | loss PP2 | loss EP2 | export logits")
    for family in FAMILIES:
        tp1 = f"{report[family, 'tp1']:.1e}" if (family, "tp1") in report else "-"
        pp2 = f"{report[family, 'pp2']:.1e}" if (family, "pp2") in report else "(test-all)"
        ep2 = f"{report[family, 'ep2']:.1e}" if (family, "ep2") in report else "-"
        print(f"{family} | {tp1} | {report[family, 'tp2']:.1e} | {pp2} | {ep2} | {report[family, 'export']:.1e}")
