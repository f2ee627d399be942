"""The planner's Megatron-FSDP terms (`pretrain/planner/fsdp.py`): sharded buffers, the gathered-unit working set,
per-microbatch communication, and Megatron-Bridge's Llama-3-8B FSDP8 H100 layout (25.11 performance summary:
DGX-H100, FP8 current scaling, sequence 8192, GBS 128, MBS 1, TP/PP/CP 1, FSDP, no recompute in its preset,
14,451 tokens/s/GPU). `plan --search` considering FSDP: test_plan.py's search test (one search fewer)."""

from __future__ import annotations

from pretrain import plan
from pretrain.config import load_config
from pretrain.planner.fsdp import fsdp_comm_bytes, fsdp_memory

BRIDGE = ["parallel.context=1", "model.fp8=tensorwise", "train.micro_batch_size=1", "train.global_batch_size=128",
          "model.seq_length=8192", "model.recompute_granularity=null"]
FSDP = ["optimizer.distributed=false", "optimizer.fsdp=true"]


def _plan(overrides: list[str]) -> dict:
    return plan.make_plan(load_config("llama3_8b", overrides), 1, 8, "h100")


def test_bridge_llama3_8b_fsdp8_layout_fits_only_with_fsdp():
    fsdp, distopt = _plan(BRIDGE + FSDP), _plan(BRIDGE)
    mem = fsdp["memory_gib"]
    print(f"Llama-3-8B, 8×H100, Bridge's FSDP8 layout: Megatron-FSDP {mem}, fits {fsdp['fits']}; distributed "
          f"optimizer {distopt['memory_gib']['total']} GiB, fits {distopt['fits']}; FSDP {fsdp['fsdp']}; cost model "
          f"{fsdp['cost_model']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (Bridge measured 14,451)")
    assert fsdp["layout"]["fsdp"] == "optim_grads_params" and fsdp["fits"] and not distopt["fits"]
    params = fsdp["num_parameters"]
    assert abs(mem["weights"] * 8 * plan.GIB - params * 2) < 8 * plan.GIB * 0.01  # bf16 weights sharded 8 ways
    assert abs(mem["gradients"] * 8 * plan.GIB - params * 4) < 8 * plan.GIB * 0.01  # fp32 grads sharded
    assert abs(mem["optimizer"] * 8 * plan.GIB - params * 12) < 8 * plan.GIB * 0.01  # Adam + fp32 main, sharded
    assert fsdp["fsdp"]["largest_unit_parameters"] == 128256 * 4096  # the embedding, gathered whole
    # 16 microbatches × (2 all-gathers of bf16 + 1 reduce-scatter of fp32) × 7/8 of the parameters
    assert abs(fsdp["fsdp"]["comm_bytes_per_step"] - 16 * 7 / 8 * params * 8) / (16 * params * 8) < 1e-3


def test_zero2_keeps_whole_weights_and_one_gather_per_step():
    # model.vocab_size: the embedded tokenizer's size, given (loading the tokenizer to count it takes a minute)
    cfg = load_config("tiny_llama", ["optimizer.fsdp=true", "optimizer.fsdp_sharding=optim_grads",
                                     "train.precision=bf16", "train.global_batch_size=16", "model.vocab_size=32000"])
    lay = plan.layout_of(cfg, 4, on_gpu=True, use_te=False)
    vocab = plan.padded_vocab_for(cfg)
    zero2 = fsdp_memory(cfg, lay, vocab, 0)
    zero3 = fsdp_memory(load_config("tiny_llama", ["optimizer.fsdp=true", "train.precision=bf16"]),
                        plan.layout_of(load_config("tiny_llama", ["optimizer.fsdp=true", "train.precision=bf16"]), 4,
                                       on_gpu=True, use_te=False), vocab, 0)
    n = zero2.static.params
    assert zero2.static.weights == n * 2 and zero3.static.weights == -(-n // 4) * 2
    assert zero2.gathered_params == 0 and zero3.gathered_params == 2 * zero3.largest_unit * 2
    dense, _ = fsdp_comm_bytes(cfg.optimizer, lay, n, 0)
    assert dense == 3 / 4 * n * (lay.num_microbatches * 4 + 2)

