#!/usr/bin/env bash
# Kimi K2 (1.04T, MoE, MLA) as Megatron-Bridge publishes its H100 pretraining recipe: 64 nodes x 8 H100, TP2 + SP,
# PP16 with the layout Etttt|(tttt|)*14tL, EP32, GBS 4096, BF16, MuonClip (pretrain/configs/kimi_k2.yaml).
# Usage: docs/slurm.md, docs/training.md ("Muon").
#   sbatch launch/pretrain_kimi_k2.sh
#   OPTIMIZER=adamw sbatch launch/pretrain_kimi_k2.sh     # AdamW with the distributed optimizer instead of Muon
# Every #SBATCH line below is a default: the same option on the sbatch command line wins.
#SBATCH --job-name=pretrain-kimi-k2
#SBATCH --nodes=64
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

CONFIG=${CONFIG:-pretrain/configs/kimi_k2.yaml}
case ${OPTIMIZER:-muon} in
    muon) layout=() ;;
    adamw) layout=(optimizer.name=adamw optimizer.distributed=true optimizer.overlap_param_gather=true) ;;
    *) launch_die "OPTIMIZER=$OPTIMIZER: use muon or adamw" ;;
esac
launch_pretrain "${layout[@]}"
