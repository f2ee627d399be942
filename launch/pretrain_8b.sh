#!/usr/bin/env bash
# Llama-3-8B on 1 node x 8 H100/H200. Usage and settings: docs/slurm.md.
#   sbatch launch/pretrain_8b.sh                           # FP8 (current/"tensorwise" scaling)
#   PRECISION=bf16 sbatch launch/pretrain_8b.sh            # BF16 variant
#   sbatch --nodes=4 launch/pretrain_8b.sh                 # 32 GPUs: data parallel x4
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-8b
#SBATCH --nodes=1
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

CONFIG=${CONFIG:-pretrain/configs/llama3_8b.yaml}

# The layout lives in $CONFIG (pretrain/configs/llama3_8b.yaml: TP1 PP1 CP2, DP4 on one node); the script
# adds only the precision (PRECISION, FP8 by default).
layout=()
launch_precision_layout
launch_pretrain "${layout[@]}"
