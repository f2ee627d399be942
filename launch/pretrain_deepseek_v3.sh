#!/usr/bin/env bash
# DeepSeek-V3 (671B, MoE, one MTP layer) with the pipeline layouts and performance settings Megatron-Bridge publishes
# (performance recipes: Megatron-Core's pipeline_model_parallel_layout strings, recompute modules, DeepEP/HybridEP,
# CUDA graphs). Usage: docs/slurm.md, docs/moe.md.
#   sbatch launch/pretrain_deepseek_v3.sh                       # 32 nodes x 8 B200: PP8 VP2 EP32, GBS 4096, MXFP8,
#                                                               #   layout Et*4|(t*4|)*14tmL
#   LAYOUT=h100 sbatch --nodes=128 launch/pretrain_deepseek_v3.sh   # 128 nodes x 8 H100: TP2 PP8 VP4 EP64, GBS 8192,
#                                                               #   FP8, layout Et|(tt|)*30mL
#   PRECISION=bf16 sbatch launch/pretrain_deepseek_v3.sh        # BF16
# (pretrain/configs/deepseek_v3.yaml alone is the planner's PP16 layout: launch/pretrain_deepseek.sh with CONFIG.)
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-dsv3
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.log
# --signal: USR1 to this shell 15 minutes before the time limit; the ranks save and the job requeues.

if [[ -z ${PROJECT_DIR:-} && -n ${SLURM_JOB_ID:-} ]]; then
    PROJECT_DIR=$(scontrol show job -o "$SLURM_JOB_ID" | sed -n 's|.* Command=\(/[^ ]*\)/launch/[^/ ]* .*|\1|p')
fi
PROJECT_DIR=${PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$PROJECT_DIR/launch/common.sh" || { echo "cannot source $PROJECT_DIR/launch/common.sh" >&2; exit 1; }

CONFIG=${CONFIG:-pretrain/configs/deepseek_v3.yaml}
LAYOUT=${LAYOUT:-b200}

placement=(parallel.num_layers_in_first_pipeline_stage=null parallel.num_layers_in_last_pipeline_stage=null
           parallel.context=1 parallel.expert_tensor=1 train.micro_batch_size=1 model.seq_length=4096)
# Both recipes recompute MLA's up-projections and the dense layers' MLP; the B200 one dispatches through DeepEP with
# the all-to-all overlapped and CUDA graphs of attention and the router, the H100 one through HybridEP.
recompute=(model.recompute_granularity=selective "model.recompute_modules=[mla_up_proj,mlp]")
case $LAYOUT in
    b200) layout=("${placement[@]}" "${recompute[@]}" parallel.tensor=1 parallel.sequence_parallel=false
                  parallel.pipeline=8 parallel.virtual_pipeline=2 "parallel.pipeline_layout=Et*4|(t*4|)*14tmL"
                  parallel.expert=32 train.global_batch_size=4096 performance.moe_flex_dispatcher_backend=deepep
                  performance.overlap_moe_expert_parallel_comm=true performance.cuda_graph_impl=transformer_engine
                  "performance.cuda_graph_scope=[attn,moe_router,moe_preprocess]") ;;
    h100) layout=("${placement[@]}" "${recompute[@]}" parallel.tensor=2 parallel.sequence_parallel=true
                  parallel.pipeline=8 parallel.virtual_pipeline=4 "parallel.pipeline_layout=Et|(tt|)*30mL"
                  parallel.expert=64 train.global_batch_size=8192 performance.moe_flex_dispatcher_backend=hybridep) ;;
    *) launch_die "LAYOUT=$LAYOUT: use b200 or h100" ;;
esac
launch_precision_layout
[[ $LAYOUT == b200 && ${PRECISION:-fp8} == fp8 ]] && layout+=(model.fp8=mxfp8)
launch_pretrain "${layout[@]}"
