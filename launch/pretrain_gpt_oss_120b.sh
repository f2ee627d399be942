#!/usr/bin/env bash
# gpt-oss-120b as Megatron-Bridge runs it on H100 (its performance summary: 5,824 tokens/s/GPU): 8 nodes x 8 H100,
# TP1, PP4, EP8 (expert TP 1), DP16, GBS 1280, BF16, selective recompute of norms and the experts' activation
# (pretrain/configs/gpt_oss_120b.yaml). Usage: docs/slurm.md, docs/moe.md ("GPT-OSS").
#   sbatch launch/pretrain_gpt_oss_120b.sh
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-gpt-oss-120b
#SBATCH --nodes=8
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

CONFIG=${CONFIG:-pretrain/configs/gpt_oss_120b.yaml}
launch_pretrain
