#!/bin/bash
# A/B comparison: the same training run twice, back to back, without and with --domino (all
# other settings identical, same seed and data), then megatron_domino.tools.ab_report reads both JSON logs
# (and Megatron-LM's TFLOP/s/GPU from each run's train.log) and writes AB_DIR/table.md,
# AB_DIR/ab.json and AB_DIR/ab.png.
#
#   MODEL=gpt3-13b MOCK=1 sbatch --nodes=1 examples/ab_compare.sh          # srun, one task per GPU
#   LAUNCHER=torchrun MODEL=llama2-7b MOCK=1 sbatch examples/ab_compare.sh  # srun torchrun per node
#   source .venv/bin/activate && LAUNCHER=local bash examples/ab_compare.sh # CPU smoke, tiny model
#   DRY_RUN=1 MOCK=1 bash examples/ab_compare.sh                           # print the commands only
#
# Knobs are those of the training recipes (examples/README.md), plus LAUNCHER (srun, torchrun
# or local), AB_DIR (default ./ab_results; its logs are overwritten), WARMUP_ITERS (iterations
# left out of the medians; default 10 % of them, at least 1) and SYSTEM (a name for the
# machine in the table). DOMINO_CHUNKS, DOMINO_COLUMN_CHUNKS, ... shape the Domino arm.
# The allocation has 8 tasks per node so that both srun styles fit in it.
# --exclusive gives the job the whole node (no neighbour's traffic in a measurement),
# all of its GPUs included; the ranks per node are the GPUs asked for (--gpus-per-node).
#SBATCH --job-name=domino-ab
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=01:00:00
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

LAUNCHER=${LAUNCHER:-srun}
recipe_setup "$LAUNCHER"
AB_DIR=${AB_DIR:-$PWD/ab_results}
base_port=$MASTER_PORT

arm_index=0
for arm in baseline domino; do
    # A fresh rendezvous port per run, in case the previous run's port is still in TIME_WAIT.
    MASTER_PORT=$((base_port + arm_index))
    export MASTER_PORT
    recipe_launcher
    recipe_pretrain_args "$([[ $arm == domino ]] && echo 1 || echo 0)" "$AB_DIR/$arm"
    if ((!DRY_RUN)); then
        # Start both logs empty (train.log is appended to) so the report sees this run only.
        mkdir -p "$AB_DIR/$arm"
        rm -f "$AB_DIR/$arm/log.jsonl" "$AB_DIR/$arm/train.log"
    fi
    recipe_run "$arm" "$AB_DIR/$arm/train.log"
    arm_index=$((arm_index + 1))
done

domino_setting="p=$DOMINO_CHUNKS k=$DOMINO_COLUMN_CHUNKS"
((DOMINO_INTER_LAYER)) || domino_setting+=" intra-layer"
((DOMINO_BACKWARD_OVERLAP)) || domino_setting+=" no-backward-overlap"
# The report is megatron-domino's A/B report command, run from this checkout like the script.
REPORT_CMD=(env "PYTHONPATH=$RECIPE_REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -m megatron_domino.tools.ab_report
    --baseline "$AB_DIR/baseline/log.jsonl" --domino "$AB_DIR/domino/log.jsonl"
    --out-dir "$AB_DIR" --gpus "$WORLD_SIZE" ${WARMUP_ITERS:+--warmup "$WARMUP_ITERS"}
    --tokens-per-iteration "$((GLOBAL_BATCH_SIZE * MODEL_CFG[SEQ_LENGTH]))"
    ${SYSTEM:+--meta "system=$SYSTEM"} --meta "model=$MODEL_NAME" --meta "nodes=$NNODES"
    --meta "precision=$([[ $BF16 == 1 ]] && echo bf16 || echo fp32)"
    --meta "micro_batch_size=$MICRO_BATCH_SIZE" --meta "global_batch_size=$GLOBAL_BATCH_SIZE"
    --meta "seq_length=${MODEL_CFG[SEQ_LENGTH]}" --meta "tp=$TP" --meta "pp=$PP"
    --meta "sequence_parallel=$SEQUENCE_PARALLEL" --meta "transformer_impl=$TRANSFORMER_IMPL"
    --meta "launcher=$LAUNCHER" --meta "domino=$domino_setting")
if ((DRY_RUN)); then
    echo "# report"
    printf '%q ' "${REPORT_CMD[@]}" | sed 's/ $//'
    echo
else
    "${REPORT_CMD[@]}"
fi
