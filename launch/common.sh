# shellcheck shell=bash
# Shared logic of launch/pretrain_*.sh. Sourced, never executed; each script sets CONFIG's default and
# its layout overrides, then calls `launch_pretrain LAYOUT_OVERRIDE...`. Documentation: docs/slurm.md.
#
# What one attempt (one start of the batch job, first run or requeue) does:
#   1. resolve settings from the environment (table below), print them with the restart count;
#   2. `python -m pretrain validate CONFIG OVERRIDES run.dir=RUN_DIR --world-size N --check-lock` on the batch
#      node: a bad layout fails the job in seconds, before any rank starts, with the validator's message in
#      the job log; so does a RUN_DIR another live trainer holds (a duplicate submission; exit 1, nothing in
#      RUN_DIR touched), while the lock of an earlier attempt of this job (a requeue) is taken over;
#   3. `srun` one task per GPU (or CPU rank) running `python -m pretrain train`, torch's RANK/WORLD_SIZE/
#      LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT mapped from Slurm's variables; the trainer
#      resumes from the latest checkpoint in RUN_DIR by itself;
#   4. a signal (`#SBATCH --signal=B:USR1@T` before the time limit, preemption's SIGTERM, or
#      `scancel --signal=USR1 --batch JOB`) is forwarded to the ranks, which save a checkpoint, write
#      RUN_DIR/exit_status.json and exit 0;
#   5. from exit_status.json: "completed" ends the job; "signal"/"time_limit" requeue it
#      (`scontrol requeue`, same job id, same RUN_DIR, SLURM_RESTART_COUNT+1); so does "hang" (a rank's
#      watchdog found a step past its bound, wrote RUN_DIR/hang/ and exited 75: the job resumes from the
#      last checkpoint, like after a preemption, bounded by MAX_RESTARTS); a failure requeues at
#      most MAX_FAILED_RESTARTS times in a row without progress, then the job fails. The trainer writes
#      "running" at start, so a file still saying "running" means the ranks were killed (no final status);
#   6. "stage" (exit 76: a run in stages saved the checkpoint that ends a stage, and the next stage changes the
#      layout; docs/training.md "Stages"): step 3 again in the same allocation, which continues in the next stage
#      (requeued instead when a signal came).
#
# Environment (all optional; `sbatch --export=ALL`, the default, passes them from the submitting shell):
#   CONFIG               trainer YAML (relative: to the submit directory, then to the checkout)
#   OVERRIDES            dotted overrides, applied after the script's layout overrides, split into words as a
#                        shell would (quotes and backslashes group; nothing is expanded or run), e.g.
#                        "train.steps=6 parallel.tensor=2" or 'run.name="my run" data.blend=["/d/a b"]'
#   RUN_DIR              run directory: checkpoints, metrics.jsonl, exit_status.json
#                        (default: <checkout>/runs/<job name>-<job id>; set it to resume an older run)
#   PYTHON               interpreter (default: <checkout>/.venv/bin/python if present, else `python`;
#                        `python` inside a container)
#   CONTAINER_IMAGE      run the ranks (and the validator) in this image via pyxis
#   CONTAINER_MOUNTS     pyxis mounts (default: the checkout and RUN_DIR at the same paths)
#   PROJECT_DIR          the checkout (default: found from the submitted script's path)
#   MAX_FAILED_RESTARTS  requeues after failures without progress in between (default 2)
#   MAX_RESTARTS         requeues in total, any reason (default 100)
#   SRUN_ARGS            extra srun arguments, split into words like OVERRIDES (e.g. "--label")
#   LAUNCH_PRINT_OVERRIDES  1: print CONFIG and the overrides the job would pass, one per line, and exit
#                        (no Slurm needed; e.g. for `python -m pretrain plan`)
# Node count and ranks per node come from `sbatch --nodes=N --ntasks-per-node=R`.

launch_log() { printf '[launch %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
launch_die() {
    printf '[launch %s] error: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
    exit 1
}

# launch_words NAME TEXT WHAT: split TEXT into the array NAME as a shell splits words ('...' and "..." quote,
# backslash escapes) without expanding or running anything (xargs's quoting); WHAT names TEXT in the error
# an unmatched quote gives.
launch_words() {
    local -n launch_words_out=$1
    local tmp status=0
    launch_words_out=()
    [[ -n ${2//[[:space:]]/} ]] || return 0
    tmp=$(mktemp) || launch_die "cannot create a temporary file to split $3"
    printf '%s\n' "$2" | xargs printf '%s\0' >"$tmp" 2>"$tmp.err" || status=$?
    if ((status != 0)); then
        local why
        why=$(head -n1 "$tmp.err")
        why=${why#xargs: }
        rm -f "$tmp" "$tmp.err"
        launch_die "$3 cannot be split into words (${why%%;*}): $2"
    fi
    # shellcheck disable=SC2034  # a nameref: the caller's array
    mapfile -d '' -t launch_words_out <"$tmp"
    rm -f "$tmp" "$tmp.err"
}

# launch_precision_layout: append PRECISION's overrides (fp8 | bf16, default fp8) to the caller's `layout`.
# FP8 uses current ("tensorwise") scaling; FP8 parameter all-gather halves the distributed optimizer's traffic.
launch_precision_layout() {
    case ${PRECISION:-fp8} in
        fp8) layout+=(model.fp8=tensorwise model.fp8_param_gather=true) ;;
        bf16) layout+=(model.fp8=null model.fp8_param_gather=false) ;;
        *) launch_die "PRECISION=$PRECISION: use fp8 or bf16" ;;
    esac
}

# ---------------------------------------------------------------------------------------------------
# Cluster environment for NCCL / Transformer Engine / CUDA. Each is a default: a value already in the
# environment wins. They do nothing on CPU (gloo) runs.
# ---------------------------------------------------------------------------------------------------
launch_export_runtime_env() {
    # Megatron-Core's TP/SP communication overlap relies on kernels being issued to the GPU in program
    # order; one hardware work queue per device guarantees that (Megatron asserts it for some overlaps).
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # Fewer cached-allocator fragments on long runs with changing activation shapes.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    # Async collectives free their buffers without recordStream: lower peak memory.
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    # Leave SMs to the overlapped TP communication kernels while TE's LayerNorm kernels run.
    export NVTE_FWD_LAYERNORM_SM_MARGIN=${NVTE_FWD_LAYERNORM_SM_MARGIN:-16}
    export NVTE_BWD_LAYERNORM_SM_MARGIN=${NVTE_BWD_LAYERNORM_SM_MARGIN:-16}
    # Warnings only; set NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to debug a hang at start.
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # Hangs (docs/training.md "Faults"): NCCL's own watchdog aborts a collective past the process group's
    # timeout (hang.process_group_timeout_s) and, with the flight recorder on, dumps each rank's last
    # collectives to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank> (read them with `torchfrtrace`); the trainer's
    # watchdog (hang.*) fires first and writes Python stacks to RUN_DIR/hang/.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
    export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
    export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$RUN_DIR/hang/nccl_trace_rank_}
    # Site specific, left to the cluster's module/env files: NCCL_SOCKET_IFNAME (bootstrap interface),
    # NCCL_IB_HCA / NCCL_IB_SL (InfiniBand), NCCL_NET_GDR_LEVEL, and on AWS/GCP their NCCL plugins.
    # One intra-op thread per rank, as torchrun does; ranks already fill the cores.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # Unbuffered, so the job log shows progress as it happens and the last lines survive a kill.
    export PYTHONUNBUFFERED=1
}

# ---------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------
launch_abs_path() {  # launch_abs_path PATH: relative to the submit directory
    case $1 in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s/%s\n' "${SLURM_SUBMIT_DIR:-$PWD}" "$1" ;;
    esac
}

launch_resolve_settings() {
    [[ -n ${SLURM_JOB_ID:-} ]] || launch_die "not inside a Slurm job: submit with \`sbatch $0\`" \
        "(or run it inside \`salloc\`)"
    [[ -n ${PROJECT_DIR:-} && -f $PROJECT_DIR/launch/common.sh ]] ||
        launch_die "PROJECT_DIR='${PROJECT_DIR:-}' is not a checkout with launch/common.sh"

    [[ -n ${CONFIG:-} ]] || launch_die "CONFIG is empty: set it to a trainer YAML"
    if [[ $CONFIG != /* ]]; then
        if [[ -f ${SLURM_SUBMIT_DIR:-$PWD}/$CONFIG ]]; then
            CONFIG=${SLURM_SUBMIT_DIR:-$PWD}/$CONFIG
        else
            CONFIG=$PROJECT_DIR/$CONFIG
        fi
    fi
    [[ -f $CONFIG ]] || launch_die "CONFIG=$CONFIG does not exist"

    RUN_DIR=$(launch_abs_path "${RUN_DIR:-$PROJECT_DIR/runs/${SLURM_JOB_NAME:-pretrain}-$SLURM_JOB_ID}")
    mkdir -p "$RUN_DIR" || launch_die "cannot create RUN_DIR=$RUN_DIR"

    if [[ -z ${PYTHON:-} ]]; then
        if [[ -z ${CONTAINER_IMAGE:-} && -x $PROJECT_DIR/.venv/bin/python ]]; then
            PYTHON=$PROJECT_DIR/.venv/bin/python
        else
            PYTHON=python
        fi
    fi
    if [[ -z ${CONTAINER_IMAGE:-} ]]; then
        command -v "$PYTHON" >/dev/null || launch_die "PYTHON=$PYTHON not found on $(hostname)"
    fi

    launch_words LAUNCH_USER_OVERRIDES "${OVERRIDES:-}" OVERRIDES
    local o
    for o in "${LAUNCH_USER_OVERRIDES[@]}"; do
        [[ $o == *=* ]] || launch_die "OVERRIDES item '$o' is not key=value"
        [[ $o != run.dir=* ]] || launch_die "set RUN_DIR instead of run.dir in OVERRIDES" \
            "(the batch script reads RUN_DIR/exit_status.json)"
    done

    LAUNCH_WORLD_SIZE=${SLURM_NTASKS:-}
    [[ $LAUNCH_WORLD_SIZE =~ ^[0-9]+$ ]] ||
        launch_die "SLURM_NTASKS is unset: submit with --nodes and --ntasks-per-node"
    LAUNCH_TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-$((LAUNCH_WORLD_SIZE / ${SLURM_JOB_NUM_NODES:-1}))}

    # Rendezvous: TCPStore on the job's first node, on a port derived from the job id (distinct for
    # jobs sharing a node, the same across requeues of one job).
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    [[ -n $MASTER_ADDR ]] || launch_die "cannot expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
    if ! getent hosts "$MASTER_ADDR" >/dev/null; then
        # Node names that do not resolve (NodeName != host name): use Slurm's NodeAddr instead.
        local addr
        addr=$(scontrol show node "$MASTER_ADDR" -o | sed -n 's/.* NodeAddr=\([^ ]*\) .*/\1/p')
        [[ -n $addr ]] || launch_die "first node $MASTER_ADDR does not resolve and has no NodeAddr"
        MASTER_ADDR=$addr
    fi
    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))  # not inherited: a stale one would collide
    export MASTER_ADDR MASTER_PORT

    MAX_FAILED_RESTARTS=${MAX_FAILED_RESTARTS:-2}
    MAX_RESTARTS=${MAX_RESTARTS:-100}
    [[ $MAX_FAILED_RESTARTS =~ ^[0-9]+$ && $MAX_RESTARTS =~ ^[0-9]+$ ]] ||
        launch_die "MAX_FAILED_RESTARTS and MAX_RESTARTS must be non-negative integers"

    LAUNCH_CONTAINER_ARGS=()
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        local mounts=$PROJECT_DIR:$PROJECT_DIR
        [[ $RUN_DIR == "$PROJECT_DIR"/* ]] || mounts+=,$RUN_DIR:$RUN_DIR
        LAUNCH_CONTAINER_ARGS=(--container-image="$CONTAINER_IMAGE"
            --container-mounts="${CONTAINER_MOUNTS:-$mounts}" --container-workdir="$PROJECT_DIR")
    fi
}

# ---------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------
launch_validate() {  # launch_validate OVERRIDE...: exit the job if the layout is rejected
    # --check-lock: a live trainer holding RUN_DIR (a duplicate submission) ends this job before anything in
    # RUN_DIR is touched (exit 1, the holder named above), instead of failing and requeueing against it.
    local cmd=("$PYTHON" -m pretrain validate "$CONFIG" "$@" "run.dir=$RUN_DIR" --world-size "$LAUNCH_WORLD_SIZE"
        --check-lock) rc=0
    launch_log "validate: ${cmd[*]}"
    if ((${#LAUNCH_CONTAINER_ARGS[@]})); then
        # The host may have no Python environment: validate in one container task on the first node.
        srun --nodes=1 --ntasks=1 "${LAUNCH_CONTAINER_ARGS[@]}" "${cmd[@]}" || rc=$?
    else
        "${cmd[@]}" || rc=$?
    fi
    if ((rc == 2)); then
        launch_log "layout rejected by the validator for world size $LAUNCH_WORLD_SIZE" \
            "($SLURM_JOB_NUM_NODES node(s) x $LAUNCH_TASKS_PER_NODE task(s)); not starting training, not requeueing"
        exit 2
    elif ((rc != 0)); then
        launch_log "validator failed with exit code $rc (not a layout verdict; exit 1 after an error line naming" \
            "another live trainer of RUN_DIR); not starting training, not requeueing"
        exit "$rc"
    fi
}

# Signals. SIGUSR1 arrives in the batch shell only (`--signal=B:...`): forward it to the ranks through
# srun. SIGTERM (scancel, preemption) reaches the ranks from Slurm directly: just note it. A signal that
# arrives before srun has started (during validation) is remembered: training is then not started.
launch_on_signal() {
    LAUNCH_SIGNAL=$1
    if [[ $1 == USR1 && -n ${LAUNCH_SRUN_PID:-} ]]; then
        launch_log "received SIG$1: forwarding to the ranks (they save a checkpoint and exit)"
        kill -USR1 "$LAUNCH_SRUN_PID" 2>/dev/null || true
    else
        launch_log "received SIG$1"
    fi
}

launch_trap_signals() {
    LAUNCH_SIGNAL=
    LAUNCH_SRUN_PID=
    trap 'launch_on_signal USR1' USR1
    trap 'launch_on_signal TERM' TERM
}

launch_train() {  # launch_train OVERRIDE...: sets LAUNCH_SRUN_RC
    local srun_args extra
    launch_words extra "${SRUN_ARGS:-}" SRUN_ARGS
    srun_args=(--kill-on-bad-exit=1 --ntasks="$LAUNCH_WORLD_SIZE" --ntasks-per-node="$LAUNCH_TASKS_PER_NODE")
    # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): without it each rank is bound to
    # a single core where Slurm binds tasks to CPUs.
    [[ -z ${SLURM_CPUS_PER_TASK:-} ]] || srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    srun_args+=("${LAUNCH_CONTAINER_ARGS[@]}" "${extra[@]}")
    # torch.distributed's environment from Slurm's, per task (evaluated in the task, hence the quotes).
    # shellcheck disable=SC2016
    local rank_env='export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
        LOCAL_WORLD_SIZE=$LAUNCH_TASKS_PER_NODE GROUP_RANK=$SLURM_NODEID; exec "$@"'
    export LAUNCH_TASKS_PER_NODE
    local cmd=("$PYTHON" -m pretrain train "$CONFIG" "$@" "run.dir=$RUN_DIR")
    launch_log "train: srun ${srun_args[*]} ${cmd[*]}"

    rm -f "$RUN_DIR/exit_status.json"  # written afresh by rank 0 of this attempt
    if [[ -n $LAUNCH_SIGNAL ]]; then
        launch_requeue "SIG$LAUNCH_SIGNAL arrived before training started"
    fi
    srun "${srun_args[@]}" bash -c "$rank_env" rank-env "${cmd[@]}" &
    LAUNCH_SRUN_PID=$!
    if [[ $LAUNCH_SIGNAL == USR1 ]]; then  # arrived between the check above and srun's start
        launch_on_signal USR1
    fi
    # `wait` returns early when a trapped signal arrives; wait again until srun itself has exited.
    while :; do
        LAUNCH_SRUN_RC=0
        wait "$LAUNCH_SRUN_PID" || LAUNCH_SRUN_RC=$?
        kill -0 "$LAUNCH_SRUN_PID" 2>/dev/null || break
    done
    LAUNCH_SRUN_PID=
    launch_log "srun exited with code $LAUNCH_SRUN_RC${LAUNCH_SIGNAL:+ after SIG$LAUNCH_SIGNAL}"
}

launch_next_stage() {  # true when the trainer stopped at a stage boundary (exit 76) and no signal came
    local status_file=$RUN_DIR/exit_status.json reason="" step="?"
    [[ -f $status_file && -z $LAUNCH_SIGNAL ]] || return 1
    reason=$(sed -n 's/.*"reason": *"\([a-z_]*\)".*/\1/p' "$status_file")
    [[ $reason == stage ]] || return 1
    step=$(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$status_file")
    rm -f "$RUN_DIR/.launch_failures"  # a checkpoint was saved: progress
    launch_log "a stage ended at step $step and the next one changes the layout: starting it in this allocation"
    return 0
}

launch_requeue() {  # launch_requeue WHY
    launch_log "requeueing job $SLURM_JOB_ID ($1); it resumes from the latest checkpoint in $RUN_DIR"
    if scontrol requeue "$SLURM_JOB_ID"; then
        exit 0
    fi
    launch_log "scontrol requeue failed (job cancelled, or requeue not permitted); not requeued"
    exit 1
}

launch_finish() {  # decide from exit_status.json and srun's exit code
    local status_file=$RUN_DIR/exit_status.json reason="" step="?" failures_file=$RUN_DIR/.launch_failures
    local failures=0 restarts=${SLURM_RESTART_COUNT:-0}
    if [[ -f $status_file ]]; then
        reason=$(sed -n 's/.*"reason": *"\([a-z_]*\)".*/\1/p' "$status_file")
        step=$(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$status_file")
        launch_log "exit status: $(tr -d '\n' <"$status_file")"
        [[ $reason != running ]] || launch_log "the trainer did not finish cleanly: killed before writing its final status"
    else
        launch_log "no $status_file: the trainer did not finish cleanly"
    fi
    [[ -f $failures_file ]] && failures=$(<"$failures_file")

    if [[ $reason == completed && $LAUNCH_SRUN_RC == 0 ]]; then
        rm -f "$failures_file"
        launch_log "training completed at step $step after $restarts restart(s)"
        exit 0
    fi
    if [[ ($reason == signal || $reason == time_limit) && $LAUNCH_SRUN_RC == 0 ]]; then
        rm -f "$failures_file"  # a checkpoint was saved: progress, the failure streak ends
        ((restarts < MAX_RESTARTS)) || {
            launch_log "checkpoint saved at step $step, but MAX_RESTARTS=$MAX_RESTARTS reached; not requeueing"
            exit 3
        }
        launch_requeue "trainer saved at step $step after ${reason/_/ }"
    fi
    if [[ $reason == stage ]]; then  # exit 76 with a signal pending: the next stage in the next attempt
        rm -f "$failures_file"
        ((restarts < MAX_RESTARTS)) || {
            launch_log "stage ended at step $step, but MAX_RESTARTS=$MAX_RESTARTS reached; not requeueing"
            exit 3
        }
        launch_requeue "a stage ended at step $step; the next stage starts in the next attempt"
    fi
    if [[ $reason == hang ]]; then  # the watchdog's exit (75): nothing saved since the last checkpoint
        rm -f "$failures_file"
        ((restarts < MAX_RESTARTS)) || {
            launch_log "hang at step $step (RUN_DIR/hang/), but MAX_RESTARTS=$MAX_RESTARTS reached; not requeueing"
            exit 3
        }
        launch_requeue "a rank hung after step $step (stacks in $RUN_DIR/hang/)"
    fi
    if [[ -n $LAUNCH_SIGNAL && (! -f $status_file || $reason == running) ]]; then
        # E.g. USR1 while the ranks were still starting, before their handlers were installed: they died
        # without saving, but nothing was lost since the last checkpoint and the time limit is near.
        ((restarts < MAX_RESTARTS)) || {
            launch_log "ranks ended after SIG$LAUNCH_SIGNAL without saving; MAX_RESTARTS=$MAX_RESTARTS reached"
            exit 3
        }
        launch_requeue "ranks ended after SIG$LAUNCH_SIGNAL without saving (srun exit $LAUNCH_SRUN_RC)"
    fi
    failures=$((failures + 1))
    echo "$failures" >"$failures_file"
    if ((failures > MAX_FAILED_RESTARTS || restarts >= MAX_RESTARTS)); then
        launch_log "training failed (srun exit $LAUNCH_SRUN_RC, reason '${reason:-none}'); $failures failure(s)" \
            "in a row, MAX_FAILED_RESTARTS=$MAX_FAILED_RESTARTS: giving up"
        exit "$((LAUNCH_SRUN_RC == 0 ? 1 : LAUNCH_SRUN_RC))"
    fi
    launch_requeue "failure $failures of at most $MAX_FAILED_RESTARTS in a row (srun exit $LAUNCH_SRUN_RC)"
}

# ---------------------------------------------------------------------------------------------------
# Entry point: launch_pretrain LAYOUT_OVERRIDE... (the script's own overrides; OVERRIDES come after
# them, so the user's win).
# ---------------------------------------------------------------------------------------------------
launch_pretrain() {
    set -euo pipefail
    if [[ ${LAUNCH_PRINT_OVERRIDES:-} == 1 ]]; then
        local extra
        launch_words extra "${OVERRIDES:-}" OVERRIDES
        printf '%s\n' "$CONFIG" "$@" "${extra[@]}"
        exit 0
    fi
    launch_trap_signals
    launch_resolve_settings
    launch_export_runtime_env
    local overrides=("$@" "${LAUNCH_USER_OVERRIDES[@]}")
    launch_log "job ${SLURM_JOB_ID} (${SLURM_JOB_NAME:-?}) restart ${SLURM_RESTART_COUNT:-0}:" \
        "${SLURM_JOB_NUM_NODES:-?} node(s) [${SLURM_JOB_NODELIST}] x $LAUNCH_TASKS_PER_NODE task(s)" \
        "= world size $LAUNCH_WORLD_SIZE; master $MASTER_ADDR:$MASTER_PORT"
    launch_log "CONFIG=$CONFIG RUN_DIR=$RUN_DIR PYTHON=$PYTHON${CONTAINER_IMAGE:+ CONTAINER_IMAGE=$CONTAINER_IMAGE}"
    cd "$PROJECT_DIR"  # `python -m pretrain` from the checkout, whatever the submit directory
    launch_validate "${overrides[@]}"
    launch_train "${overrides[@]}"
    while launch_next_stage; do  # a run in stages: the next stage's new processes, same allocation
        launch_train "${overrides[@]}"
    done
    launch_finish
}
