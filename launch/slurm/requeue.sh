# Sourced by the sbatch templates (not a job itself): run a training step so that SLURM's
# warning before the time limit ends it with a checkpoint, and requeue the job to continue.
#
#   #SBATCH --signal=B:TERM@300   SLURM sends SIGTERM to this batch shell 300 s before the limit
#   #SBATCH --requeue
#   run_requeueable RUN_DIR srun ... launch/<step>.py ... --resume
#
# On that SIGTERM the shell creates RUN_DIR/STOP. Every rank on every node watches for it (and
# for SIGTERM/SIGINT or its launcher's death: mmadapt/faults.py), finishes its update, saves a
# complete checkpoint and exits 75. The job is then requeued, and --resume continues it from
# that checkpoint. A step that exits 75 for another reason (a signal sent by hand) is requeued too,
# and so is one that exits 76: paused by --exit_interval before its last update.

run_requeueable() {
    local run_dir=$1
    shift
    local stopping=0 rc=0 status=""
    # mkdir: the warning can come before the step made its run directory (finetune.sbatch makes
    # only its parent); a failed touch under the template's set -e would end the batch shell.
    # Trapped first: a warning before the trap ended the batch shell.
    trap 'stopping=1; { mkdir -p "$run_dir" && touch "$run_dir/STOP"; } || true' TERM
    # The step's own status, written by the subshell that runs it: once the warning's trap cut
    # the first `wait` short (143) and the step ended while the trap ran, a second `wait` gave
    # -1 (or 127 in posix mode), and a step that had saved and exited 75 was not requeued. A
    # TMPDIR that is not there on this node falls back to /tmp; with no file, wait's status.
    status=$(mktemp 2>/dev/null || mktemp -p /tmp 2>/dev/null) || status=""
    # The subshell outlives a SIGTERM to the whole process group (scancel, preemption: `: TERM`)
    # and waits for the step, which gets the signal as it is (the default, or its own handler);
    # it exits with the step's status however the file's write went (/tmp full: set -e ended it).
    ( trap : TERM; set +e; "$@"; code=$?
      [[ -z $status ]] || { echo "$code" > "$status"; } 2>/dev/null
      exit "$code" ) &
    local pid=$!
    wait "$pid" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while the step is still saving.
    while [[ $rc -gt 128 ]] && kill -0 "$pid" 2>/dev/null; do
        rc=0
        wait "$pid" || rc=$?
    done
    trap - TERM
    if [[ -n $status ]]; then
        if [[ -s $status ]]; then  # (empty: the subshell itself was killed; its status is wait's)
            rc=$(<"$status")
        fi
        rm -f "$status"
    fi
    # After the warning, a step killed by a signal (status > 128: it could not say whether it
    # saved) is requeued too, --resume takes the newest complete checkpoint; one that finished
    # (0) or failed (1-3: a traceback, bad input, a divergence; 74: a full disk) is not: it would
    # only run again
    if [[ $rc -eq 75 || $rc -eq 76 || ( $stopping -eq 1 && $rc -gt 128 ) ]] && [[ -n "${SLURM_JOB_ID:-}" ]]; then
        echo "stopped with a complete checkpoint in $run_dir: requeueing job $SLURM_JOB_ID to resume it"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$rc"
}
