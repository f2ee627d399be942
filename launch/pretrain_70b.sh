#!/usr/bin/env bash
# Llama-3-70B on 8 nodes x 8 H100/H200. Usage and settings: docs/slurm.md.
#   sbatch launch/pretrain_70b.sh                          # FP8 (current/"tensorwise" scaling)
#   PRECISION=bf16 sbatch launch/pretrain_70b.sh           # BF16 variant (H200; see below for H100)
#   OVERRIDES="train.steps=1000" RUN_DIR=/lustre/runs/70b sbatch --nodes=16 launch/pretrain_70b.sh
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.log
# --signal: USR1 to this shell 10 minutes before the time limit (Slurm may send it up to ~30 s
# early); the ranks save a checkpoint (70B with optimizer state is ~1 TB:
# allow minutes on a parallel file system) and the job requeues itself.

# Slurm runs a copy of this file from its spool directory: find the checkout it was submitted from.
if [[ -z ${PROJECT_DIR:-} && -n ${SLURM_JOB_ID:-} ]]; then
    PROJECT_DIR=$(scontrol show job -o "$SLURM_JOB_ID" | sed -n 's|.* Command=\(/[^ ]*\)/launch/[^/ ]* .*|\1|p')
fi
PROJECT_DIR=${PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$PROJECT_DIR/launch/common.sh" || { echo "cannot source $PROJECT_DIR/launch/common.sh" >&2; exit 1; }

CONFIG=${CONFIG:-pretrain/configs/llama3_70b.yaml}

# The layout lives in $CONFIG (pretrain/configs/llama3_70b.yaml: TP4 PP8 VP5, the layout Megatron-Bridge
# publishes for Llama-3-70B FP8 on 64 H100s). The script adds only what needs the GPUs: FP8 (PRECISION) and
# TP communication overlapped with GEMMs (Transformer Engine userbuffers). Memory, as planned for this launch
# (`LAUNCH_PRINT_OVERRIDES=1 launch/pretrain_70b.sh` prints CONFIG and the overrides `python -m pretrain plan`
# needs; docs/performance.md): FP8 fits an 80 GB H100; PRECISION=bf16 needs 141 GB H200s, or on H100s
# Megatron-Bridge's BF16 layout, OVERRIDES="parallel.pipeline=4 parallel.context=2".
layout=(parallel.tp_comm_overlap=true)
launch_precision_layout
launch_pretrain "${layout[@]}"
