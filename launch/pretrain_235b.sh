#!/usr/bin/env bash
# Qwen3-235B-A22B (MoE): the layouts Megatron-Bridge publishes (docs/performance-summary.md, 25.11). Usage: docs/slurm.md,
# docs/moe.md.
#   sbatch launch/pretrain_235b.sh                              # 32 nodes x 8 H100: TP2 PP8 VP4 EP32, GBS 2048, FP8
#   GPU=b200 sbatch --nodes=8 launch/pretrain_235b.sh           # 8 nodes x 8 B200: TP1 PP8 VP2 EP8, GBS 1024, MXFP8
#   PRECISION=bf16 sbatch launch/pretrain_235b.sh               # BF16
# 94 layers on 32 (16) virtual stages: the embedding and the loss count as one layer each in the split.
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-235b
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

CONFIG=${CONFIG:-pretrain/configs/qwen3_235b_a22b.yaml}
GPU=${GPU:-h100}

case $GPU in
    h100) layout=() ;;
    b200) layout=(parallel.tensor=1 parallel.sequence_parallel=false parallel.virtual_pipeline=2 parallel.expert=8
                  train.global_batch_size=1024) ;;
    *) launch_die "GPU=$GPU: use h100 or b200" ;;
esac
launch_precision_layout
[[ $GPU == b200 && ${PRECISION:-fp8} == fp8 ]] && layout+=(model.fp8=mxfp8)
launch_pretrain "${layout[@]}"
