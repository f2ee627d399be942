"""Formatting plans and search results for people."""

from __future__ import annotations

from typing import Any

from pretrain.planner.common import FRAGMENTATION, RESERVE_GIB


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text for people."""
    lay, mem, thr, cm = plan["layout"], plan["memory_gib"], plan["throughput"], plan["cost_model"]
    vp = f" VP{lay['virtual_pipeline']}" if lay["virtual_pipeline"] else ""
    if lay.get("first_stage_layers") is not None or lay.get("last_stage_layers") is not None:
        vp += f" (layers: first stage {lay['first_stage_layers'] or 'even'}, last {lay['last_stage_layers'] or 'even'})"
    lines = [
        f"plan: {plan['config']} on {plan['nodes']} node(s) × {plan['gpus_per_node']} {plan['gpu'].upper()} "
        f"= {plan['world_size']} GPUs",
        f"  layout     TP{lay['tensor']} PP{lay['pipeline']}{vp} CP{lay['context']} DP{lay['data']}"
        f"{' SP' if lay['sequence_parallel'] else ''}; micro batch {lay['micro_batch_size']}, global batch "
        f"{lay['global_batch_size']} ({lay['num_microbatches']} microbatches); {lay['precision']}"
        f"{' + FP8 ' + lay['fp8'] if lay['fp8'] else ''}; recompute {lay['recompute'] or 'none'}; "
        f"{_optimizer(lay)}; "
        f"{'Transformer Engine' if lay['transformer_engine'] else 'local'} spec",
        f"  model      {plan['num_parameters']:,} parameters{_active(plan)} (padded vocabulary "
        f"{plan['padded_vocab_size']:,}){_mtp(plan)}",
        f"  FLOPs      {plan['flops_per_token']:.4g} per token, {plan['flops_per_step']:.4g} per step",
        f"             {plan['flops_formula']}",
        f"  memory per GPU (GiB), most loaded rank = pipeline stage {plan['most_loaded_rank']['pipeline_stage']} "
        f"({plan['most_loaded_rank']['parameters']:,} parameters, "
        f"{plan['most_loaded_rank']['microbatches_in_flight']} microbatch-chunks in flight):",
    ]
    fsdp = plan.get("fsdp")
    if fsdp:
        lines.insert(3, f"  fsdp       {fsdp['sharding']} over {fsdp['shard_group']} ranks; units all-gathered "
                        f"(largest {fsdp['largest_unit_parameters']:,} parameters): {fsdp['gathered_params_gib']:.2f} "
                        f"GiB weights + {fsdp['unsharded_grads_gib']:.2f} GiB gradients in flight (in buffers); "
                        f"{fsdp['comm_bytes_per_step'] / 1e9:.1f} GB all-gathered/reduce-scattered per rank per step")
    moe = plan.get("moe")
    if moe:
        lines.insert(3, f"  experts    {moe['experts']} per layer, top-{moe['topk']}; "
                        f"ETP{moe['expert_tensor_parallel']} × EP{moe['expert_parallel']} × "
                        f"EDP{moe['expert_data_parallel']}: {moe['experts_per_rank']} "
                        f"expert{'s' if moe['experts_per_rank'] > 1 else ''} per rank "
                        f"({moe['expert_parameters_on_rank']:,} expert parameters on the most loaded "
                        f"rank); all-to-all {moe['all_to_all_bytes_per_step'] / 1e9:.2f} GB sent per rank per step")
    mu = plan.get("muon")
    if mu:
        lines.insert(3, f"  muon       {mu['muon_parameters']:,} parameters by Muon, {mu['adamw_parameters']:,} "
                        f"by AdamW on the most loaded rank{' (layer-wise over DP)' if mu['layer_wise'] else ''}: "
                        "optimizer "
                        f"{mu['optimizer_gib']:.2f} GiB (momentum {mu['momentum_gib']:.2f}, AdamW moments "
                        f"{mu['adamw_moments_gib']:.2f}, main params {mu['main_params_gib']:.2f}), all-gather "
                        f"{mu['gather_gib']:.2f} GiB in the step; Newton-Schulz "
                        f"{mu['newton_schulz_flops_per_step'] / 1e12:.2f} TFLOP per step")
    ctx = plan.get("context_parallel")
    if ctx:
        lines.insert(len(lines) - 1, _context_line(ctx))
    header = ("stage", "weights", "gradients", "optimizer", "activations", "fp8", "buffers", "total")
    lines.append("    " + "".join(f"{h:>12}" for h in header))
    for st in plan["stages"]:
        lines.append("    " + f"{st['pipeline_stage']:>12}" + "".join(f"{st[k]:>12.2f}" for k in header[1:]))
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    kept = 100 * (1 - plan["fit_limit_gib"] / plan["gpu_memory_gib"])
    lines.append(f"    peak {mem['total']:.2f} GiB of {plan['gpu_memory_gib']} GiB: {verdict} "
                 f"(keeping {kept:.0f}% headroom: {RESERVE_GIB:g} GiB + {FRAGMENTATION:.1%}; limit "
                 f"{plan['fit_limit_gib']} GiB, margin {plan['margin_gib']:+.2f} GiB)")
    if plan.get("overflow"):
        lines.append(f"    overflow: {plan['overflow']}")
    lines.append(f"  at MFU {thr['mfu']:.0%} of {thr['peak_tflops']:.0f} TFLOP/s: "
                 f"{thr['tflops_per_gpu']:.0f} TFLOP/s/GPU, {thr['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                 f"step {thr['step_time_s']:.2f} s")
    ep = f" + EP {cm['ep_exposed_s']:.2f} (of {cm['ep_comm_s']:.2f})" if moe else ""
    lines.append(f"  cost model: (compute {cm['compute_s']:.2f} s + TP {cm['tp_comm_s']:.2f} + CP {cm['cp_comm_s']:.2f}"
                 f"{ep}) × (1 + bubble {cm['bubble_fraction']:.3f}) + PP {cm['pp_comm_s']:.2f} + DP "
                 f"{cm['dp_comm_s']:.2f} + optimizer {cm['optimizer_s']:.2f} s = {cm['step_s']:.2f} s/step, "
                 f"{cm['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {cm['mfu']:.0%}")
    lines.append(f"             compute per rank: GEMMs {cm['gemm_s']:.2f} + attention {cm['attention_s']:.2f} + "
                 f"memory-bound {cm['elementwise_s']:.2f} + per-kernel {cm['kernel_s']:.2f} s (host launches "
                 f"{cm['host_s']:.2f} s; the larger bounds it); constants: pretrain/planner/constants.py")
    return "\n".join(lines)


def _optimizer(lay: dict[str, Any]) -> str:
    if lay.get("optimizer") == "muon":
        return "Muon + AdamW"
    if lay.get("fsdp"):
        return f"Megatron-FSDP ({lay['fsdp']})"
    return f"{'distributed' if lay['distributed_optimizer'] else 'replicated'} optimizer"


def _mtp(plan: dict[str, Any]) -> str:
    mtp = plan.get("num_mtp_parameters")
    out = f"; + {mtp:,} in the MTP layers (sharing the embedding and output head)" if mtp else ""
    ckpt = plan.get("checkpoint_elements")
    if ckpt and ckpt != plan["num_parameters"] and plan.get("moe"):
        out += f"; HF checkpoint {ckpt:,} elements"
    return out


def _active(plan: dict[str, Any]) -> str:
    active = plan.get("num_active_parameters")
    if not plan.get("moe") or active is None:
        return ""
    return f", {active:,} active per token ({active / plan['num_parameters']:.1%})"



def _context_line(ctx: dict[str, Any]) -> str:
    cpu = ctx["cpu_only"]
    how = f"CP{ctx['context']} {ctx['cp_comm_type']}" if ctx["cp_comm_type"] else "CP1"
    docs = ", packed documents (THD)" if ctx["packed_documents"] else ""
    return (f"  context    {how}{docs}: {ctx['comm_bytes_per_layer_microbatch'] / 2**20:,.1f} MiB sent per layer "
            f"and microbatch; CPU dry run only (local spec's CP attention): keeps "
            f"{cpu['attention_saved_bytes_per_layer'] / 2**20:,.1f} MiB per layer, works on "
            f"{cpu['attention_working_set_bytes_per_layer'] / 2**20:,.1f} MiB of scores")


def _cp(row: dict[str, Any]) -> str:
    """CP size, with the comm type when CP > 1 ("2 a2a")."""
    return f"{row['context']} {row['cp_comm_type']}" if row.get("cp_comm_type") else str(row["context"])


def format_search(results: list[dict[str, Any]], total: int) -> str:
    moe = any(r.get("expert") for r in results)
    ep_head = f" {'EP':>3}" if moe else ""
    ep_s_head = f" {'EP s':>6}" if moe else ""
    header = f"{'#':>3} {'TP':>3} {'PP':>3} {'VP':>3} {'CP':>7} {'DP':>4}{ep_head} {'FSDP':>4} {'MBS':>4} " \
             f"{'recompute':>10} " \
             f"{'mem GiB':>8} {'bubble':>7} {'TP s':>6} {'DP s':>6} {'PP s':>6} {'CP s':>6}{ep_s_head} {'step s':>7} " \
             f"{'tok/s/GPU':>10}"
    lines = [f"{total} layouts pass validation and fit; best {len(results)} by the cost model:", header]
    for i, r in enumerate(results, 1):
        c = r["cost"]
        ep = f" {r['expert']:>3}" if moe else ""
        ep_s = f" {c['ep_comm_s']:>6.2f}" if moe else ""
        lines.append(f"{i:>3} {r['tensor']:>3} {r['pipeline']:>3} {r['virtual_pipeline'] or '-':>3} "
                     f"{_cp(r):>7} {r['data']:>4}{ep} {'yes' if r.get('fsdp') else '-':>4} "
                     f"{r['micro_batch_size']:>4} {r['recompute'] or '-':>10} "
                     f"{r['memory_gib']:>8.1f} {r['bubble_fraction']:>7.3f} {c['tp_comm_s']:>6.2f} "
                     f"{c['dp_comm_s']:>6.2f} {c['pp_comm_s']:>6.2f} {c['cp_comm_s']:>6.2f}{ep_s} {r['step_s']:>7.2f} "
                     f"{r['tokens_per_s_per_gpu']:>10,.0f}")
    if results:
        lines.append(f"best: {results[0]['overrides']}")
    return "\n".join(lines)
