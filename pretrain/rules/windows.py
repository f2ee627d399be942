"""Sliding-window attention rules: `model.sliding_window`, `model.window_attn_skip_freq`, and what each attention
implementation runs with a window (`model_providers/core/windows.py` says what the keys mean).

- the local spec (CPU, or a GPU without Transformer Engine): Megatron-Core's `DotProductAttention` builds the window
  mask itself (`FusedScaleMaskSoftmax.forward_torch_softmax`; the fused kernel, which ignores it, is switched off);
  with CP > 1 or packed documents our `ContextParallelAttention` masks by the window for every `cp_comm_type`;
- Transformer Engine: its attention takes `window_size`; under context parallelism only with `cp_comm_type=a2a`,
  or `all_gather` where TE runs flash attention (its `attn_forward_func_with_cp` asserts so): p2p is refused.
"""

from __future__ import annotations

from model_providers.core.windows import window_size
from pretrain.config import ModelConfig, ParallelConfig
from pretrain.config_parse import shown
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report


def window_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, lay: Layout | None,
                 te_on_gpu: bool) -> None:
    """The window keys, and the window against MTP and Transformer Engine's context parallelism."""
    m, p = model, parallel
    freq = m.window_attn_skip_freq
    if freq is not None:
        if m.sliding_window is None:
            r.error(("model.window_attn_skip_freq", "model.sliding_window"),
                    "model.window_attn_skip_freq chooses the layers of a sliding window, but model.sliding_window "
                    "is null", "set model.sliding_window or model.window_attn_skip_freq=null")
        elif isinstance(freq, list) and (len(freq) != m.num_layers or any(v not in (0, 1) for v in freq)):
            r.error(("model.window_attn_skip_freq", "model.num_layers"),
                    f"model.window_attn_skip_freq must list 0 (full) or 1 (windowed) for each of the "
                    f"model.num_layers={m.num_layers} layers; got {shown(freq)} ({len(freq)} values)",
                    "give one 0/1 per layer, or an integer")
        elif isinstance(freq, list) and m.mtp_num_layers:
            r.error(("model.window_attn_skip_freq", "model.mtp_num_layers"),
                    "a per-layer model.window_attn_skip_freq list has no entry for the Multi-Token Prediction "
                    "layers (Megatron-Core indexes it by layer number)", "use an integer model.window_attn_skip_freq")
    if window_size(m) is None or p.context <= 1:
        return
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if use_te and p.cp_comm_type in ("p2p", "a2a+p2p"):
        r.error(("model.sliding_window", "parallel.cp_comm_type"),
                f"Transformer Engine's context-parallel attention takes a sliding window (model.sliding_window="
                f"{m.sliding_window} < model.seq_length={m.seq_length}) only with cp_comm_type a2a or all_gather, "
                f"not {p.cp_comm_type}", "set parallel.cp_comm_type=a2a")
    elif use_te and p.cp_comm_type == "all_gather":
        r.notes.append("sliding window with cp_comm_type=all_gather: Transformer Engine runs it with flash attention "
                       "only (not its fused cuDNN attention); a2a has no such limit")
