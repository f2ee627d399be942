"""The single-process cases of `test_megatron_fixes.py`, run in the world-1 launch of `conftest.py::fsdp_runs`.

A reference run saves at step 2 and trains to step 4; then, for each fix in turn, the same resume (or a load of
a planted pickle from a torch_dist and from an fsdp_dtensor checkpoint, or one step with `recompute_modules:
[layernorm]`, or one step of tiny_moe or tiny_deepseek) runs with only that fix undone.
"""

from __future__ import annotations

from pathlib import Path

from tests.pretrain.ckpt_helpers import SMALL

BASE = SMALL + ["train.steps=4", "checkpoint.interval=2", "checkpoint.save_at_end=false", "optimizer.distributed=true"]
DISTOPT = ("distopt_fresh_state_dict", "distopt_load_missing_step", "distopt_shared_step")


def fix_cases(root: Path, fsdp_evil: Path) -> list[dict]:
    """Cases writing under `root`; `fsdp_evil`: the fsdp_dtensor checkpoint with a planted pickle (world 2)."""
    marker = root / "pwned"
    one_step = ["train.steps=1", "checkpoint.interval=null", "checkpoint.save_at_end=false"]
    cases = [{"name": "ref", "overrides": BASE + [f"run.dir={root}/ref"]},
             {"name": "evil", "overrides": SMALL + ["train.steps=1", f"run.dir={root}/evil"], "evil_rng": str(marker)}]
    cases += [{"name": name, "overrides": BASE + [f"run.dir={root}/{name}"], "copy_from": [f"{root}/ref", 2],
               "without_fixes": [name]} for name in DISTOPT]
    cases.append({"name": "load_bytes_weights_only", "overrides": SMALL + [f"run.dir={root}/planner"],
                  "load_object": [f"{root}/evil/checkpoints/iter_0000001", "rng_state"],
                  "load_dcp_object": [str(fsdp_evil), "rng_state.0.python"],
                  "without_fixes": ["load_bytes_weights_only"]})
    cases.append({"name": "recompute_norms_without_te", "without_fixes": ["recompute_norms_without_te"],
                  "overrides": SMALL + one_step + ["model.recompute_granularity=selective",
                                                   "model.recompute_modules=[layernorm]", f"run.dir={root}/norms"]})
    cases.append({"name": "moe_router_without_te", "config": "tiny_moe", "without_fixes": ["moe_router_without_te"],
                  "overrides": SMALL + one_step + [f"run.dir={root}/moe"]})
    for name in ("mla_local_core_attention", "mla_without_te", "mla_q_norm_without_q_lora"):  # MLA, local spec
        q_lora = ["model.q_lora_rank=null"] if name == "mla_q_norm_without_q_lora" else []  # Moonlight-style
        cases.append({"name": name, "config": "tiny_deepseek", "without_fixes": [name],
                      "overrides": SMALL + one_step + q_lora + [f"run.dir={root}/{name}"]})
    return cases
