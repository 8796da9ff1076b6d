#!/bin/bash
# Pretrain a GPT model with pretrain_gpt_domino.py under SLURM, one task per GPU: srun starts
# NNODES x GPUS_PER_NODE processes (GPUs per node: the job's, from SLURM) and each takes its rank
# from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
#
#   sbatch --nodes=2 examples/pretrain_gpt_srun.sh                  # from the repository root
#   MODEL=llama2-7b DOMINO=1 MOCK=1 sbatch examples/pretrain_gpt_srun.sh
#   DRY_RUN=1 MOCK=1 bash examples/pretrain_gpt_srun.sh             # print the command only
#
# Restarts on its own: if training stops before TRAIN_ITERS (a rank or node dies, or SLURM's
# SIGTERM 5 minutes before the time limit makes every rank save and exit), the job
# requeues itself (up to MAX_REQUEUES=3 times; same job id, so the same RUN_DIR) and
# resumes from the latest complete checkpoint in CHECKPOINT_DIR (default RUN_DIR/checkpoints,
# every SAVE_INTERVAL=1000 iterations; CHECKPOINT_DIR= turns checkpoints and restarts off).
# Not requeued: a refused command line (the job fails with its exit status 2) or a failure
# before anything new was saved, which a retry would repeat (recipe_requeue_unfinished in
# lib/common.sh).
#
# Knobs (MODEL, TP, MICRO_BATCH_SIZE, DOMINO, ...) are environment variables: see
# examples/README.md. Add --partition/--account on the sbatch command line.
# --exclusive gives the job the whole node (no neighbour's traffic in a measurement),
# all of its GPUs included; the ranks per node are the GPUs asked for (--gpus-per-node).
#SBATCH --job-name=domino-gpt
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=TERM@300
set -euo pipefail

# sbatch runs a copy of this file from its spool directory; the checkout is then found
# through DOMINO_REPO or the submission directory.
examples=$(dirname "${BASH_SOURCE[0]}")
[[ -f $examples/lib/common.sh ]] || examples=${DOMINO_REPO:-${SLURM_SUBMIT_DIR:-.}}/examples
# shellcheck source=examples/lib/common.sh
if ! source "$examples/lib/common.sh"; then
    echo "${0##*/}: no checkout found: submit from its root or export DOMINO_REPO" >&2
    exit 1
fi

recipe_setup srun
CHECKPOINT_DIR=${CHECKPOINT_DIR-$RUN_DIR/checkpoints}
recipe_pretrain_args "$DOMINO" "$RUN_DIR"
recipe_launcher
status=0
recipe_run pretrain "$RUN_DIR/train.log" || status=$?
recipe_requeue_unfinished "$status"
