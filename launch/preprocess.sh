#!/usr/bin/env bash
# Preprocess a corpus on a Slurm cluster: an array job whose tasks each tokenize their share of the input files
# (balanced by bytes) into PREFIX_partNNNNN_*, then one dependent job (--dependency=afterok) that verifies every
# part and merges them (or writes their blend line). Run it on a login node; it submits both jobs:
#
#   launch/preprocess.sh --tasks 64 [--finalize merge|blend] [--remove-parts] [--max-parallel M] [--log-dir DIR]
#       [SBATCH-OPTION...] -- PREPROCESS-ARGUMENTS...
#
# PREPROCESS-ARGUMENTS are those of `python -m data_tools preprocess` (--input ... --output-prefix ...
# --tokenizer-type ...); SBATCH-OPTIONs (--partition=cpu --time=04:00:00 --cpus-per-task=16 ...) go to both jobs.
# The plan, the parts and the final step are `python -m data_tools shard-plan | shard-run | finalize`; a requeued
# task resumes its share where it stopped. Documentation: docs/data.md ("On a Slurm cluster").
# Environment: PYTHON (default <checkout>/.venv/bin/python, else python), PROJECT_DIR (the checkout).
set -euo pipefail

PROJECT_DIR=${PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$PROJECT_DIR/launch/common.sh" || { echo "cannot source $PROJECT_DIR/launch/common.sh" >&2; exit 1; }
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python
    [[ ! -x $PROJECT_DIR/.venv/bin/python ]] || PYTHON=$PROJECT_DIR/.venv/bin/python
fi

preprocess_usage() {
    launch_die "usage: launch/preprocess.sh --tasks N [--finalize merge|blend] [--remove-parts]" \
        "[--max-parallel M] [--log-dir DIR] [SBATCH-OPTION...] -- PREPROCESS-ARGUMENTS... ($*)"
}

# Inside the jobs this script submitted: one task's share, or the final step.
preprocess_in_job() {
    cd "$PROJECT_DIR"
    case $PREPROCESS_ROLE in
        task)
            launch_log "array job ${SLURM_ARRAY_JOB_ID:-?} task ${SLURM_ARRAY_TASK_ID:-?}" \
                "(restart ${SLURM_RESTART_COUNT:-0}) on node ${SLURMD_NODENAME:-$(hostname)}: plan $PREPROCESS_PLAN"
            exec "$PYTHON" -m data_tools shard-run "$PREPROCESS_PLAN" --task "$SLURM_ARRAY_TASK_ID"
            ;;
        finalize)
            launch_log "final step (job $SLURM_JOB_ID, after array job ${PREPROCESS_ARRAY_JOB:-?}):" \
                "$PREPROCESS_FINALIZE of the parts of $PREPROCESS_PLAN"
            local extra=()
            [[ ${PREPROCESS_REMOVE_PARTS:-0} != 1 ]] || extra=(--remove-parts)
            exec "$PYTHON" -m data_tools finalize "$PREPROCESS_PLAN" --mode "$PREPROCESS_FINALIZE" "${extra[@]}"
            ;;
        *) launch_die "PREPROCESS_ROLE=$PREPROCESS_ROLE: expected task or finalize" ;;
    esac
}

preprocess_submit() {
    local tasks="" finalize=merge remove=0 max_parallel="" log_dir=${PWD} sbatch_args=() plan_out plan ntasks
    while (($#)); do
        case $1 in
            --tasks) tasks=${2:-}; shift 2 || preprocess_usage "--tasks needs a value" ;;
            --tasks=*) tasks=${1#*=}; shift ;;
            --finalize) finalize=${2:-}; shift 2 || preprocess_usage "--finalize needs a value" ;;
            --finalize=*) finalize=${1#*=}; shift ;;
            --remove-parts) remove=1; shift ;;
            --max-parallel) max_parallel=${2:-}; shift 2 || preprocess_usage "--max-parallel needs a value" ;;
            --max-parallel=*) max_parallel=${1#*=}; shift ;;
            --log-dir) log_dir=${2:-}; shift 2 || preprocess_usage "--log-dir needs a value" ;;
            --log-dir=*) log_dir=${1#*=}; shift ;;
            --) shift; break ;;
            *) sbatch_args+=("$1"); shift ;;
        esac
    done
    [[ $tasks =~ ^[1-9][0-9]*$ ]] || preprocess_usage "--tasks must be a positive integer"
    [[ $finalize == merge || $finalize == blend ]] || preprocess_usage "--finalize must be merge or blend"
    [[ -z $max_parallel || $max_parallel =~ ^[1-9][0-9]*$ ]] || preprocess_usage "--max-parallel must be positive"
    (($#)) || preprocess_usage "no preprocess arguments after --"
    mkdir -p "$log_dir" || launch_die "cannot create --log-dir $log_dir"
    log_dir=$(cd "$log_dir" && pwd)
    command -v sbatch >/dev/null || launch_die "sbatch not found: run this on a Slurm login node"

    # The plan: every input file, each task's contiguous share (by bytes), the preprocess options.
    # Run here, so relative paths are the submitter's; the plan records them absolute.
    plan_out=$(PYTHONPATH=$PROJECT_DIR${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m data_tools shard-plan \
        --tasks "$tasks" -- "$@") ||
        launch_die "no plan made (see the error above); nothing submitted"
    read -r plan ntasks <<<"$plan_out"
    # The jobs get this environment (sbatch's default --export=ALL): the checkout, the interpreter, their role.
    export PROJECT_DIR PYTHON PREPROCESS_PLAN=$plan
    local script=$PROJECT_DIR/launch/preprocess.sh common=(--requeue --open-mode=append "${sbatch_args[@]}")
    local array_job final_job
    array_job=$(PREPROCESS_ROLE=task sbatch --parsable --job-name=preprocess \
        --array="0-$((ntasks - 1))${max_parallel:+%$max_parallel}" --output="$log_dir/%x-%A_%a.log" \
        "${common[@]}" "$script") || launch_die "sbatch of the array job failed"
    array_job=${array_job%%;*}
    final_job=$(PREPROCESS_ROLE=finalize PREPROCESS_FINALIZE=$finalize PREPROCESS_REMOVE_PARTS=$remove \
        PREPROCESS_ARRAY_JOB=$array_job sbatch --parsable --job-name=preprocess-final \
        --dependency="afterok:$array_job" --kill-on-invalid-dep=yes --output="$log_dir/%x-%j.log" \
        "${common[@]}" "$script") ||
        launch_die "sbatch of the final job failed (array job $array_job is queued: scancel it?)"
    final_job=${final_job%%;*}
    launch_log "plan $plan: $ntasks task(s)"
    launch_log "array job $array_job (tasks 0-$((ntasks - 1))): logs $log_dir/preprocess-${array_job}_<task>.log"
    launch_log "final job $final_job ($finalize, after every task succeeded): log $log_dir/preprocess-final-$final_job.log"
    echo "$array_job $final_job"
}

if [[ -n ${SLURM_JOB_ID:-} && -n ${PREPROCESS_ROLE:-} ]]; then
    preprocess_in_job
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
    launch_die "run launch/preprocess.sh on a login node, not with sbatch: it submits the array and the final job"
else
    preprocess_submit "$@"
fi
