#!/usr/bin/env bash
# Llama-3.1-405B: the layouts Megatron-Bridge publishes (docs/performance-summary.md, 25.11). Usage: docs/slurm.md.
#   sbatch launch/pretrain_405b.sh                              # 128 nodes x 8 H100: TP8 PP8 VP8 CP2, GBS 512, FP8
#   GPU=b200 sbatch --nodes=16 launch/pretrain_405b.sh          # 16 nodes x 8 B200: TP4 PP8 VP8 CP2, GBS 64, FP8
#   PRECISION=bf16 sbatch launch/pretrain_405b.sh               # BF16
# 126 layers on 64 virtual stages: the embedding and the loss count as one layer each in the split (the config's
# parallel.account_for_*_in_pipeline_split; `python -m pretrain validate` prints the placement).
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-405b
#SBATCH --nodes=128
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

CONFIG=${CONFIG:-pretrain/configs/llama31_405b.yaml}
GPU=${GPU:-h100}

case $GPU in
    h100) layout=(parallel.tp_comm_overlap=true) ;;
    b200) layout=(parallel.tensor=4 parallel.tp_comm_overlap=true train.global_batch_size=64) ;;
    *) launch_die "GPU=$GPU: use h100 or b200" ;;
esac
launch_precision_layout
launch_pretrain "${layout[@]}"
