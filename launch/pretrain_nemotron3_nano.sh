#!/usr/bin/env bash
# Nemotron 3 Nano 30B-A3B as Megatron-Bridge runs it (its performance summary: 32,768 tokens/s/GPU on 8 B200):
# one node of 8 GPUs, TP1, PP1, EP8 (expert TP 1), DP8, GBS 512 x 8192 tokens, micro-batch 2, bf16
# (pretrain/configs/nemotron3_nano.yaml). Usage: docs/slurm.md, docs/hybrid.md.
#   sbatch launch/pretrain_nemotron3_nano.sh
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-nemotron3-nano
#SBATCH --nodes=1
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

CONFIG=${CONFIG:-pretrain/configs/nemotron3_nano.yaml}
launch_pretrain
