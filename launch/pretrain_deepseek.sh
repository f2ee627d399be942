#!/usr/bin/env bash
# Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA, 64 routed + 2 shared experts, aux-loss-free balancing) on 2 nodes
# x 8 H100/H200. Usage and settings: docs/slurm.md, docs/moe.md ("DeepSeek-V3 class").
#   sbatch launch/pretrain_deepseek.sh                     # BF16
#   PRECISION=fp8 sbatch launch/pretrain_deepseek.sh       # FP8 (current/"tensorwise" scaling, TE grouped GEMM)
#   MTP=1 sbatch launch/pretrain_deepseek.sh               # with one Multi-Token Prediction layer (DeepSeek-V3 style)
#   OPTIMIZER=adamw sbatch launch/pretrain_deepseek.sh     # AdamW (distributed optimizer) instead of Muon
#   sbatch --nodes=4 launch/pretrain_deepseek.sh           # 32 GPUs: data parallel x2 (experts: expert DP x2)
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-deepseek
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.log
# --signal: USR1 to this shell 5 minutes before the time limit; the ranks save and the job requeues.

# Slurm runs a copy of this file from its spool directory: find the checkout it was submitted from.
if [[ -z ${PROJECT_DIR:-} && -n ${SLURM_JOB_ID:-} ]]; then
    PROJECT_DIR=$(scontrol show job -o "$SLURM_JOB_ID" | sed -n 's|.* Command=\(/[^ ]*\)/launch/[^/ ]* .*|\1|p')
fi
PROJECT_DIR=${PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$PROJECT_DIR/launch/common.sh" || { echo "cannot source $PROJECT_DIR/launch/common.sh" >&2; exit 1; }

CONFIG=${CONFIG:-pretrain/configs/moonlight_16b_a3b.yaml}
PRECISION=${PRECISION:-bf16}
MTP=${MTP:-null}
OPTIMIZER=${OPTIMIZER:-muon}

# 15B of the 16B parameters are routed experts. Expert parallelism 8 puts 8 of the 64 experts of every MoE layer on
# each GPU of a node, so the token all-to-all stays on NVLink (EP ranks are consecutive); no pipeline: the 27 layers
# (the first dense) and the 2 shared experts per layer (1.0B parameters with attention and embeddings) are data
# parallel over all 16 GPUs, their optimizer state sharded over DP16, the experts' over expert DP2. Expert TP 1
# keeps every expert's GEMMs whole. MLA runs through Transformer Engine (its down-projections duplicated per rank).
# Muon (as Moonlight was trained): Megatron-Core's layer-wise distributed optimizer shards it over DP by whole
# matrices; AdamW: the distributed optimizer.
case $OPTIMIZER in
    muon) optimizer=(optimizer.name=muon optimizer.distributed=false optimizer.muon.layer_wise=true
                     optimizer.overlap_grad_reduce=true optimizer.overlap_param_gather=false) ;;
    adamw) optimizer=(optimizer.name=adamw optimizer.distributed=true optimizer.overlap_grad_reduce=true
                      optimizer.overlap_param_gather=true) ;;
    *) echo "OPTIMIZER=$OPTIMIZER: use muon or adamw" >&2; exit 1 ;;
esac
layout=(
    parallel.tensor=1 parallel.pipeline=1 parallel.virtual_pipeline=null parallel.context=1
    parallel.expert=8 parallel.expert_tensor=1 parallel.sequence_parallel=false
    model.seq_length=4096 train.global_batch_size=512 train.micro_batch_size=1 "model.mtp_num_layers=$MTP"
    "${optimizer[@]}" train.precision=bf16
)
launch_precision_layout
launch_pretrain "${layout[@]}"
