"""What Megatron-Core's hybrid model (`MambaModel`) offers per release, for the rules of `pretrain/rules/hybrid.py`.

0.16.1–0.18: `MambaModel(hybrid_override_pattern=...)`; `MambaStack` splits pipeline stages itself (evenly, or by
`num_layers_in_first/last_pipeline_stage`), asserts there is no virtual pipeline, ignores
`pipeline_model_parallel_layout`, and has no Multi-Token Prediction.
0.19+: `HybridModel` (`MambaModel` its deprecated name): the unified `hybrid_layer_pattern` carries pipeline segment
boundaries (`|`, one segment per model chunk, virtual stages included) and MTP depths (`/`, one pattern per depth).
Our placement (`parallel.pipeline_layout`, the embedding / loss in the split, first / last stage layers, virtual
stages) becomes those boundaries and `model.mtp_layer_pattern` × `model.mtp_num_layers` the depths
(`model_providers/core/mamba_builder.py`), so a reason below is None from 0.19 on.
The model itself is built release by release in `model_providers/core/mamba_builder.py` (found from its classes).
"""

from __future__ import annotations

from pretrain.compat.mcore import _pick

VP_REASON, LAYOUT_REASON, MTP_REASON = _pick({
    "0.16.1": ("Megatron-Core's MambaStack asserts there is none (0.16.1-0.18)",
               "Megatron-Core's MambaStack ignores pipeline_model_parallel_layout (0.16.1-0.18); 0.19+ takes "
               "it (as '|' boundaries in the hybrid pattern)",
               "Megatron-Core's MambaModel has none (0.16.1-0.18); 0.19+ has it (the hybrid pattern's '/' depths)"),
    "0.19": (None, None, None),
})
