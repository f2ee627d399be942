"""Which Megatron fixes the installed Megatron-Core needs, observed before start-up patches anything; then what
start-up applies. `python tests/pretrain/compat_probe.py` prints {"need": {fix: bool}, "applied": [...]} (JSON);
tests/pretrain/test_compat.py compares the two. Each probe looks at Megatron-Core (or torch) itself, not at the
fix's declared releases; the bug behind each fix, with the fix undone, is shown in test_megatron_fixes.py."""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


class Marker:
    """A class no weights-only unpickler allows."""


def unpickles_anything() -> bool:
    """torch's DCP load planner (Megatron's MCoreLoadPlanner inherits it) unpickles checkpoint bytes freely."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    data = io.BytesIO()
    torch.save(Marker(), data)
    data.seek(0)
    try:
        planner.load_bytes(types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="x")), data)
    except Exception:
        return False
    return isinstance(planner.state_dict.get("x"), Marker)


def te_placeholder_breaks_isinstance(module: types.ModuleType) -> bool:
    """The module's `TELinear`, without TE, is a placeholder that `isinstance` refuses."""
    import torch

    te_linear = getattr(module, "TELinear", None)
    if te_linear is None:
        return False
    try:
        isinstance(torch.nn.Linear(1, 1), (te_linear,))
    except TypeError:
        return True
    return False


def need() -> dict[str, bool]:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe import moe_utils

    no_te = importlib.util.find_spec("transformer_engine") is None
    torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE  # the three distopt bugs are torch Adam's (no TE / apex)
    return {
        "distopt_fresh_state_dict": torch_adam, "distopt_load_missing_step": torch_adam,
        "distopt_shared_step": torch_adam,
        "load_bytes_weights_only": unpickles_anything(),
        "recompute_norms_without_te": no_te and CheckpointWithoutOutput().fp8 is True,  # fp8=False reads as True
        "moe_router_without_te": "te_general_gemm" not in vars(moe_utils),  # the router tests a name never defined
        "fsdp_tp_without_te": te_placeholder_breaks_isinstance(mcore_fsdp_adapter),
        "mla_local_core_attention": "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters,
        "mla_without_te": no_te and bool(mla.HAVE_TE),  # MLA believes TE is there
        "mla_q_norm_without_q_lora": hasattr(mla.MLASelfAttention, "_resolve_qk_norm_config"),  # 0.19's resolver
    }  # fmt: skip


def main() -> int:
    from pretrain import compat

    compat.import_megatron(on_gpu=False)  # megatron.core as start-up first imports it, nothing patched
    print(json.dumps({"need": need(), "applied": compat.apply(on_gpu=False)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
