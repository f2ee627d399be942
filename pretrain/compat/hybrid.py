"""What Megatron-Core's hybrid model (`MambaModel`) offers per release, for the rules of `pretrain/rules/hybrid.py`.

0.16.1–0.18: `MambaModel(hybrid_override_pattern=...)`; `MambaStack` splits pipeline stages itself (evenly, or by
`num_layers_in_first/last_pipeline_stage`), asserts there is no virtual pipeline, ignores
`pipeline_model_parallel_layout`, and has no Multi-Token Prediction.
0.19+: `HybridModel` (`MambaModel` its deprecated name): the unified `hybrid_layer_pattern` carries pipeline stage
boundaries (`|`, also for virtual stages) and MTP layers (`/`); neither is wired into our config here.
The model itself is built release by release in `model_providers/core/mamba_builder.py` (found from its classes).
"""

from __future__ import annotations

from pretrain.compat.mcore import _pick

VP_REASON, LAYOUT_REASON, MTP_REASON = _pick({
    "0.16.1": ("Megatron-Core's MambaStack asserts there is none (0.16.1-0.18)",
               "Megatron-Core's MambaStack ignores pipeline_model_parallel_layout (0.16.1-0.18)",
               "Megatron-Core's MambaModel has none (0.16.1-0.18)"),
    "0.19": ("Megatron-Core 0.19+ takes virtual stages as '|' boundaries in the hybrid pattern, not wired here "
             "(HybridModel refuses virtual stages without them; parallel.pipeline_layout is not translated into them)",
             "Megatron-Core 0.19+ takes stage boundaries as '|' in the hybrid pattern, not wired here",
             "Megatron-Core 0.19+ takes MTP layers as a '/' pattern after the hybrid pattern (Nemotron 3 Super's "
             "'*E'), not wired here (no key for that pattern; the CPU stack spec, the planner and the HF mapping "
             "have no MTP block)"),
})
