#!/usr/bin/env bash
# Tiny Llama on CPU (gloo) or GPU: the script the Slurm tests run. Usage and settings: docs/slurm.md.
#   sbatch --nodes=2 --ntasks-per-node=2 launch/pretrain_tiny.sh
#   OVERRIDES="data.mock=true train.steps=20" RUN_DIR=runs/tiny sbatch launch/pretrain_tiny.sh
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.log

# Slurm runs a copy of this file from its spool directory: find the checkout it was submitted from.
if [[ -z ${PROJECT_DIR:-} && -n ${SLURM_JOB_ID:-} ]]; then
    PROJECT_DIR=$(scontrol show job -o "$SLURM_JOB_ID" | sed -n 's|.* Command=\(/[^ ]*\)/launch/[^/ ]* .*|\1|p')
fi
PROJECT_DIR=${PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$PROJECT_DIR/launch/common.sh" || { echo "cannot source $PROJECT_DIR/launch/common.sh" >&2; exit 1; }

CONFIG=${CONFIG:-pretrain/configs/tiny_llama.yaml}
launch_pretrain  # no layout overrides: the config's own layout, OVERRIDES on top
