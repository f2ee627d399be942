#!/usr/bin/env bash
# Qwen3-30B-A3B (Mixture of Experts) on 2 nodes x 8 H100/H200. Usage and settings: docs/slurm.md, docs/moe.md.
#   sbatch launch/pretrain_moe.sh                          # BF16
#   PRECISION=fp8 sbatch launch/pretrain_moe.sh            # FP8 (current/"tensorwise" scaling, TE grouped GEMM)
#   sbatch --nodes=4 launch/pretrain_moe.sh                # 32 GPUs: data parallel x2 (experts: expert DP x2)
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-moe
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

CONFIG=${CONFIG:-pretrain/configs/qwen3_30b_a3b.yaml}
PRECISION=${PRECISION:-bf16}

# 29B of the 30.5B parameters are experts. Expert parallelism 8 puts 16 of the 128 experts of every layer
# on each GPU of a node, so the token all-to-all stays on NVLink (EP ranks are consecutive within a pipeline
# stage); pipeline parallelism 2 puts 24 layers on each node (one point-to-point hop between the nodes per
# microbatch). Attention (1.5B parameters) runs without TP, data parallel over the 8 GPUs of a stage; expert
# TP 1 keeps every expert's GEMMs whole. The distributed optimizer shards the attention's state over DP8.
layout=(
    parallel.tensor=1 parallel.pipeline=2 parallel.virtual_pipeline=null parallel.context=1
    parallel.expert=8 parallel.expert_tensor=1 parallel.sequence_parallel=false
    model.seq_length=4096 train.global_batch_size=256 train.micro_batch_size=1
    optimizer.distributed=true optimizer.overlap_grad_reduce=true optimizer.overlap_param_gather=true
    train.precision=bf16
)
launch_precision_layout
launch_pretrain "${layout[@]}"
