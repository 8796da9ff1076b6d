#!/bin/bash
# Pretrain a GPT model with pretrain_gpt_domino.py under SLURM, one task per node: srun starts
# torchrun on each node, torchrun starts a rank per GPU there (GPUS_PER_NODE: the job's, from
# SLURM), and the c10d rendezvous on the first node numbers them (RANK, WORLD_SIZE, LOCAL_RANK),
# so every node runs the same command.
#
#   sbatch --nodes=2 examples/pretrain_gpt_torchrun.sh               # from the repository root
#   MODEL=llama2-7b DOMINO=1 MOCK=1 sbatch examples/pretrain_gpt_torchrun.sh
#   DRY_RUN=1 MOCK=1 bash examples/pretrain_gpt_torchrun.sh          # print the command only
#
# Restarts on its own: when a rank dies, torchrun restarts every rank in the allocation (up
# to MAX_RESTARTS=3 times); if training still stops before TRAIN_ITERS (a node dies, or
# SLURM's SIGTERM 5 minutes before the time limit makes every rank save and exit; torchrun
# gives its ranks 30 s for that, a longer save is cut and the one before it is used), the
# job requeues itself (up to MAX_REQUEUES=3 times; same job id, so the same RUN_DIR). Every
# restart resumes from the latest complete checkpoint in CHECKPOINT_DIR (default
# RUN_DIR/checkpoints, every SAVE_INTERVAL=1000 iterations; CHECKPOINT_DIR= turns
# checkpoints and restarts off). Not requeued: a refused command line (the job fails with
# its exit status 2) or a failure before anything new was saved, which a retry would repeat
# (recipe_requeue_unfinished in lib/common.sh).
#
# Knobs (MODEL, TP, MICRO_BATCH_SIZE, DOMINO, ...) are environment variables: see
# examples/README.md. Add --partition/--account on the sbatch command line.
# --exclusive gives the job the whole node (no neighbour's traffic in a measurement),
# all of its GPUs included; the ranks per node are the GPUs asked for (--gpus-per-node).
#SBATCH --job-name=domino-gpt
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
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

recipe_setup torchrun
CHECKPOINT_DIR=${CHECKPOINT_DIR-$RUN_DIR/checkpoints}
recipe_pretrain_args "$DOMINO" "$RUN_DIR"
recipe_launcher
status=0
recipe_run pretrain "$RUN_DIR/train.log" || status=$?
recipe_requeue_unfinished "$status"
