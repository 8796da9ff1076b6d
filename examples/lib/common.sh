# shellcheck shell=bash
# The machinery shared by the launch recipes (pretrain_gpt_srun.sh, pretrain_gpt_torchrun.sh,
# ab_compare.sh); sourced, never run. A recipe calls, in this order:
#
#   recipe_setup STYLE         STYLE = srun | torchrun | local: defaults, model config, layout
#   recipe_pretrain_args D DIR PRETRAIN_ARGS for one run; D = 1 adds the DOMINO_ARGS group,
#                              DIR receives log.jsonl (and train.log, written by recipe_run)
#   recipe_launcher            LAUNCH_CMD: the launcher and python, for STYLE
#   recipe_run LABEL LOG       print the resolved command; run it unless DRY_RUN=1
#
# Every knob is an environment variable with a default (examples/README.md lists them). The
# model's shape comes from examples/models/<MODEL>.env (KEY=VALUE data, read by
# recipe_read_model, never sourced). Flags are Megatron-LM's, parsed by Megatron-LM itself in
# pretrain_gpt_domino.py, plus its --domino* and --log-json.

#: This checkout: examples/ and the repository root, found from this file's own location.
RECIPE_EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE_REPO_DIR=$(dirname "$RECIPE_EXAMPLES_DIR")

#: Keys every model config must give, and the one it may give.
RECIPE_MODEL_KEYS=(
    NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS FFN_HIDDEN_SIZE SEQ_LENGTH
    MAX_POSITION_EMBEDDINGS VOCAB_SIZE NORMALIZATION POSITION_EMBEDDING_TYPE SWIGLU
    DISABLE_BIAS_LINEAR UNTIE_EMBEDDINGS_AND_OUTPUT_WEIGHTS ATTENTION_DROPOUT HIDDEN_DROPOUT
)
RECIPE_OPTIONAL_MODEL_KEYS=(ROTARY_BASE)

#: The variables recipe_setup exports to every rank (printed by recipe_run).
RECIPE_EXPORTS=(CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_AVOID_RECORD_STREAMS OMP_NUM_THREADS
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE MASTER_ADDR MASTER_PORT)

recipe_die() {
    echo "${0##*/}: error: $*" >&2
    exit 1
}

# recipe_require_int NAME...: each named variable holds a non-negative integer.
recipe_require_int() {
    local name
    for name in "$@"; do
        [[ ${!name} =~ ^[0-9]+$ ]] || recipe_die "$name=${!name} is not a non-negative integer."
    done
}

# recipe_require_bool NAME...: each named variable is 0 or 1.
recipe_require_bool() {
    local name
    for name in "$@"; do
        [[ ${!name} == [01] ]] || recipe_die "$name=${!name} must be 0 or 1."
    done
}

# recipe_positive_int TEXT: TEXT if it is a positive integer, else nothing.
recipe_positive_int() {
    [[ $1 =~ ^[0-9]+$ ]] && ((10#$1 > 0)) && echo "$((10#$1))"
    return 0
}

# recipe_gpus_per_node: GPUS_PER_NODE, the ranks per node, checked against the allocation.
# Inside a SLURM job it is the GPUs the job asked for per node, SLURM_GPUS_PER_NODE
# (--gpus-per-node=[type:]N); else the GPUs it has on the node, SLURM_GPUS_ON_NODE; else, for
# the srun style, its tasks per node (SLURM_NTASKS_PER_NODE). Asked for, not had: the recipes'
# #SBATCH --exclusive makes SLURM allocate every GPU and CPU of the node, so a job that asked
# for 2 GPUs on an 8-GPU node has SLURM_GPUS_ON_NODE=8. Outside SLURM (a dry run on a login
# node) 8, an H100/H200 node. A rank count above the GPUs the node gave the job is refused:
# ranks would share GPUs without a word.
recipe_gpus_per_node() {
    local requested allocated tasks per_node=${SLURM_GPUS_PER_NODE:-}
    requested=$(recipe_positive_int "${per_node##*:}")
    allocated=$(recipe_positive_int "${SLURM_GPUS_ON_NODE:-}")
    [[ -n $allocated ]] || allocated=$requested
    tasks=$(recipe_positive_int "${SLURM_NTASKS_PER_NODE:-}")
    if [[ -z ${GPUS_PER_NODE:-} ]]; then
        if [[ -n $requested || -n $allocated ]]; then
            GPUS_PER_NODE=${requested:-$allocated}
        elif [[ $RECIPE_STYLE == srun && -n $tasks ]]; then
            GPUS_PER_NODE=$tasks
        elif [[ -n ${SLURM_JOB_ID:-} ]]; then
            recipe_die "this SLURM job shows no GPU count (SLURM_GPUS_PER_NODE, \
SLURM_GPUS_ON_NODE): submit with --gpus-per-node=N, or set GPUS_PER_NODE."
        else
            GPUS_PER_NODE=8
        fi
    fi
    recipe_require_int GPUS_PER_NODE
    ((GPUS_PER_NODE >= 1)) || recipe_die "GPUS_PER_NODE=$GPUS_PER_NODE must be at least 1."
    if [[ $RECIPE_STYLE != local && -n $allocated ]] && ((GPUS_PER_NODE > allocated)); then
        recipe_die "GPUS_PER_NODE=$GPUS_PER_NODE ranks per node, but the job has $allocated \
GPUs per node: ranks would share GPUs. Leave GPUS_PER_NODE unset to use ${requested:-$allocated}."
    fi
    if [[ $RECIPE_STYLE == srun && -n $tasks ]] && ((GPUS_PER_NODE > tasks)); then
        recipe_die "one task per GPU needs $GPUS_PER_NODE tasks per node, but the job has \
$tasks (--ntasks-per-node): submit with --ntasks-per-node=$GPUS_PER_NODE."
    fi
}

# recipe_model_file MODEL: the config file of a model name (examples/models/NAME.env) or path.
recipe_model_file() {
    local model=$1
    if [[ $model == */* || $model == *.env ]]; then
        [[ -f $model ]] || recipe_die "MODEL=$model: no such file."
        echo "$model"
        return
    fi
    local file="$RECIPE_EXAMPLES_DIR/models/$model.env"
    if [[ ! -f $file ]]; then
        local known=("$RECIPE_EXAMPLES_DIR"/models/*.env)
        known=("${known[@]##*/}")
        recipe_die "MODEL=$model: no $file. Known models: ${known[*]%.env}."
    fi
    echo "$file"
}

# recipe_set_model_key SOURCE KEY VALUE: store one model setting in MODEL_CFG, checked.
recipe_set_model_key() {
    local source=$1 key=$2 value=$3
    if [[ " ${RECIPE_MODEL_KEYS[*]} ${RECIPE_OPTIONAL_MODEL_KEYS[*]} " != *" $key "* ]]; then
        recipe_die "$source: unknown model key $key (known: ${RECIPE_MODEL_KEYS[*]} \
${RECIPE_OPTIONAL_MODEL_KEYS[*]})."
    fi
    [[ $value =~ ^[A-Za-z0-9._+-]+$ ]] || recipe_die "$source: $key has no valid value ('$value')."
    MODEL_CFG[$key]=$value
}

# recipe_read_model FILE: fill MODEL_CFG from a KEY=VALUE file, then from MODEL_OVERRIDES.
# The file is parsed, not sourced: it is data, and a typo is an error rather than a no-op.
recipe_read_model() {
    local file=$1 line number=0 key word words
    declare -gA MODEL_CFG=()
    while IFS= read -r line || [[ -n $line ]]; do
        number=$((number + 1))
        line=${line%%#*}
        [[ $line =~ ^[[:space:]]*$ ]] && continue
        [[ $line =~ ^[[:space:]]*([A-Z][A-Z0-9_]*)=([^[:space:]]*)[[:space:]]*$ ]] ||
            recipe_die "$file:$number: expected KEY=VALUE, got '$line'."
        recipe_set_model_key "$file:$number" "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
    done <"$file"
    read -ra words <<<"${MODEL_OVERRIDES:-}"
    for word in "${words[@]}"; do
        [[ $word == *=* ]] || recipe_die "MODEL_OVERRIDES: expected KEY=VALUE words, got '$word'."
        recipe_set_model_key MODEL_OVERRIDES "${word%%=*}" "${word#*=}"
    done
    for key in "${RECIPE_MODEL_KEYS[@]}"; do
        [[ -n ${MODEL_CFG[$key]:-} ]] || recipe_die "$file: missing model key $key."
    done
    for key in NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS FFN_HIDDEN_SIZE \
        SEQ_LENGTH MAX_POSITION_EMBEDDINGS VOCAB_SIZE; do
        [[ ${MODEL_CFG[$key]} =~ ^[0-9]+$ ]] || recipe_die "$file: $key must be an integer."
    done
    if [[ -n ${MODEL_CFG[ROTARY_BASE]:-} ]]; then
        [[ ${MODEL_CFG[ROTARY_BASE]} =~ ^[0-9]+$ ]] || recipe_die "$file: ROTARY_BASE must be an integer."
    fi
    for key in SWIGLU DISABLE_BIAS_LINEAR UNTIE_EMBEDDINGS_AND_OUTPUT_WEIGHTS; do
        [[ ${MODEL_CFG[$key]} == [01] ]] || recipe_die "$file: $key must be 0 or 1."
    done
}

# recipe_first_node: the host of rank 0 (the rendezvous host).
recipe_first_node() {
    local hosts=()
    if [[ -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null; then
        mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    fi
    echo "${hosts[0]:-localhost}"
}

# recipe_setup STYLE: read every knob from the environment (or its default), load the model
# config and export the variables every rank needs.
recipe_setup() {
    RECIPE_STYLE=$1
    case $RECIPE_STYLE in
    srun | torchrun) ;;
    local)
        # A CPU smoke run: a tiny model on TP ranks of this machine, fp32, mock data.
        : "${MODEL:=tiny}" "${TP:=2}" "${BF16:=0}" "${MOCK:=1}" "${TRAIN_ITERS:=12}"
        : "${LOG_INTERVAL:=1}" "${NNODES:=1}" "${GPUS_PER_NODE:=$TP}" "${CPU:=1}"
        : "${EVAL_ITERS:=1}"
        ;;
    *) recipe_die "unknown launch style '$RECIPE_STYLE' (srun, torchrun or local)." ;;
    esac

    DRY_RUN=${DRY_RUN:-0}
    MODEL=${MODEL:-gpt3-6.7b}
    RECIPE_MODEL_FILE=$(recipe_model_file "$MODEL")
    MODEL_NAME=$(basename "$RECIPE_MODEL_FILE" .env)
    recipe_read_model "$RECIPE_MODEL_FILE"

    # Layout: nodes from the SLURM allocation (1 outside SLURM), ranks per node, TP and PP sizes.
    NNODES=${NNODES:-${SLURM_NNODES:-1}}
    recipe_gpus_per_node
    TP=${TP:-8}
    PP=${PP:-1}
    VP=${VP:-1}
    recipe_require_int NNODES TP PP VP
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
    ((TP >= 1 && PP >= 1 && WORLD_SIZE % (TP * PP) == 0)) ||
        recipe_die "TP=$TP x PP=$PP does not divide the $WORLD_SIZE ranks \
(NNODES=$NNODES x GPUS_PER_NODE=$GPUS_PER_NODE)."
    DP=$((WORLD_SIZE / (TP * PP)))

    # Batch and schedule. One micro-batch per data-parallel rank per step unless
    # GLOBAL_BATCH_SIZE asks for gradient accumulation.
    MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-2}
    recipe_require_int MICRO_BATCH_SIZE
    GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * DP))}
    TRAIN_ITERS=${TRAIN_ITERS:-100}
    recipe_require_int GLOBAL_BATCH_SIZE TRAIN_ITERS
    LR=${LR:-1.5e-4}
    MIN_LR=${MIN_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%g", lr / 10 }')}
    LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$((TRAIN_ITERS / 10))}
    LOG_INTERVAL=${LOG_INTERVAL:-10}
    SEED=${SEED:-1234}
    BF16=${BF16:-1}
    recipe_require_int LR_WARMUP_ITERS LOG_INTERVAL SEED
    recipe_require_bool BF16

    # Data: MOCK=1 trains on Megatron-Core's synthetic tokens; otherwise a prepared dataset
    # and its tokenizer, one of Megatron-LM's (--tokenizer-type).
    MOCK=${MOCK:-0}
    recipe_require_bool MOCK
    TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}
    if ((!MOCK)); then
        if [[ $TOKENIZER_TYPE == GPT2BPETokenizer ]]; then
            [[ -n ${DATA_PATH:-} && -n ${VOCAB_FILE:-} && -n ${MERGE_FILE:-} ]] ||
                recipe_die "no data: set DATA_PATH (a .bin/.idx prefix, or 'W1 P1 W2 P2' for a \
blend), VOCAB_FILE and MERGE_FILE (GPT-2's vocab.json and merges.txt), or set MOCK=1 for \
synthetic data."
        elif [[ -z ${DATA_PATH:-} || -z ${TOKENIZER_MODEL:-} ]]; then
            recipe_die "no data: set DATA_PATH (a .bin/.idx prefix, or 'W1 P1 W2 P2' for a blend) \
and TOKENIZER_MODEL (a SentencePiece .model, e.g. from 'python -m megatron_domino.data.prepare'; \
with TOKENIZER_TYPE=HuggingFaceTokenizer a Hugging Face tokenizer), or set MOCK=1 for \
synthetic data."
        fi
    fi

    DOMINO=${DOMINO:-0}
    DOMINO_CHUNKS=${DOMINO_CHUNKS:-2}
    DOMINO_COLUMN_CHUNKS=${DOMINO_COLUMN_CHUNKS:-1}
    DOMINO_SPLIT=${DOMINO_SPLIT:-batch}
    [[ $DOMINO_SPLIT == batch || $DOMINO_SPLIT == sequence ]] ||
        recipe_die "DOMINO_SPLIT=$DOMINO_SPLIT must be batch or sequence."
    DOMINO_INTER_LAYER=${DOMINO_INTER_LAYER:-1}
    DOMINO_BACKWARD_OVERLAP=${DOMINO_BACKWARD_OVERLAP:-1}
    recipe_require_bool DOMINO DOMINO_INTER_LAYER DOMINO_BACKWARD_OVERLAP
    recipe_require_int DOMINO_CHUNKS DOMINO_COLUMN_CHUNKS

    # CPU=1: the CPU replacements of Megatron-LM's GPU defaults (CPU_ARGS), for smoke runs
    # and dry runs on machines without GPUs; the local launch style is one.
    CPU=${CPU:-0}
    recipe_require_bool CPU
    # Megatron-LM's default layers are Transformer Engine's; Megatron-Core's own ('local')
    # are the CPU's, and the ones Domino's column split and sequence split need.
    TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-$( ((CPU)) && echo local || echo transformer_engine)}
    [[ $TRANSFORMER_IMPL == local || $TRANSFORMER_IMPL == transformer_engine ]] ||
        recipe_die "TRANSFORMER_IMPL=$TRANSFORMER_IMPL must be transformer_engine or local."
    # The distributed optimizer, as Megatron-LM's GPU recipes run it, also with CPU=1: without
    # Apex or Transformer Engine its resume needs the CPU runtime's patches of its load
    # (megatron_domino/training/loop_runtime.py), which pretrain_gpt_domino.py applies.
    DISTRIBUTED_OPTIMIZER=${DISTRIBUTED_OPTIMIZER:-1}
    OVERLAP_GRAD_REDUCE=${OVERLAP_GRAD_REDUCE:-1}
    # With TE layers Domino overlaps the backward collectives under sequence parallelism only
    # (without it TE keeps its own input-gradient all-reduce), so SP is on with TE by default.
    SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-$([[ $TRANSFORMER_IMPL == transformer_engine ]] &&
        echo 1 || echo 0)}
    recipe_require_bool DISTRIBUTED_OPTIMIZER OVERLAP_GRAD_REDUCE SEQUENCE_PARALLEL
    FP8_FORMAT=${FP8_FORMAT:-}
    # The FP8 recipes Domino runs (megatron_domino/refusals.py: _FP8_RECIPES_RUN); delayed
    # scaling by default, current scaling (tensorwise) and 1x128 blocks (blockwise) on request.
    FP8_RECIPE=${FP8_RECIPE:-delayed}
    [[ $FP8_RECIPE == delayed || $FP8_RECIPE == tensorwise || $FP8_RECIPE == blockwise ]] ||
        recipe_die "FP8_RECIPE=$FP8_RECIPE must be delayed, tensorwise or blockwise (the FP8 recipes Domino runs)."
    # MODEL_CLASS: gpt (GPTModel, pretrain_gpt.py's) or hybrid (Megatron-Core's HybridModel,
    # pretrain_hybrid.py's, where megatron-core 0.19 sends GPTModel users): MODEL's layers,
    # each cut into an attention layer '*' and an MLP layer '-', the pattern split into PP
    # segments by '|'. HybridModel's final norm is Transformer Engine's whatever the layers.
    MODEL_CLASS=${MODEL_CLASS:-gpt}
    [[ $MODEL_CLASS == gpt || $MODEL_CLASS == hybrid ]] ||
        recipe_die "MODEL_CLASS=$MODEL_CLASS must be gpt or hybrid."
    if [[ $MODEL_CLASS == hybrid ]]; then
        ((VP == 1)) || recipe_die "MODEL_CLASS=hybrid with VP=$VP: Megatron-LM builds HybridModel without virtual pipeline stages; use VP=1."
        ((CPU)) && [[ -z ${TRAIN_SCRIPT:-} ]] &&
            recipe_die "MODEL_CLASS=hybrid with CPU=1: HybridModel's final norm is Transformer Engine's, which does not run on the CPU; in a checkout, TRAIN_SCRIPT=tests/pretrain_te_cpu.py runs TE's Python on its CPU backend."
    fi
    # Megatron-LM 0.19 needs --eval-interval; its examples evaluate every 1000 iterations on
    # 10 batches, and once more after training (EVAL_ITERS=0: no evaluation at all).
    EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
    EVAL_ITERS=${EVAL_ITERS:-10}
    recipe_require_int EVAL_INTERVAL EVAL_ITERS
    ((EVAL_INTERVAL >= 1)) || recipe_die "EVAL_INTERVAL=$EVAL_INTERVAL must be at least 1."

    PYTHON=${PYTHON:-python}
    TORCHRUN=${TORCHRUN:-torchrun}
    # Restarts without a person: torchrun's in the allocation (torchrun style), SLURM's requeue
    # of an unfinished job (recipe_requeue_unfinished).
    MAX_RESTARTS=${MAX_RESTARTS:-3}
    MAX_REQUEUES=${MAX_REQUEUES:-3}
    recipe_require_int MAX_RESTARTS MAX_REQUEUES
    local run_id=${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}
    RUN_DIR=${RUN_DIR:-$PWD/runs/$MODEL_NAME-tp$TP-${NNODES}n-$run_id}

    # --- Environment of every rank ------------------------------------------------------
    # One hardware queue per device, so kernels start in the order they were launched: an
    # all-reduce launched before an independent GEMM starts first and then runs alongside
    # it. With several queues the GEMM may be scheduled first and fill the GPU, and the
    # collective runs after it - the overlap Domino (and Megatron's own) arranges is lost.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # Domino launches its tensor-parallel all-reduces with async_op=True. PyTorch releases
    # before mid-2025 then call record_stream on their tensors, which keeps that memory from
    # being reused until the caching allocator notices the NCCL stream is done, and TP runs
    # grow in memory; with 1 the tensors are held until wait() instead (Domino waits on every
    # handle). Newer PyTorch does this by default (pytorch/pytorch#150398); 1 is harmless there.
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    # torchrun sets 1 thread per rank; set the same under plain srun so both launch styles
    # run alike (8 ranks x all cores of CPU threads would oversubscribe the node).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # torchrun's agent shares its rendezvous TCPStore with the ranks by default, and the store
    # keeps the keys of the attempt before a restart (--max-restarts): the restarted ranks read
    # a dead rank's address and NCCL's (or gloo's) connect fails (pytorch/pytorch#135712, still
    # so in torch 2.13). With 1 every attempt's rank 0 hosts a fresh store. No effect under srun.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
    # Rank 0's host and a port; the srun style's ranks read them (pretrain_gpt_domino.py
    # takes rank and world size from SLURM_PROCID/SLURM_NTASKS), torchrun's rendezvous uses
    # them. The port is derived from the job id so two jobs sharing a node do not collide.
    MASTER_ADDR=${MASTER_ADDR:-$(recipe_first_node)}
    if [[ -z ${MASTER_PORT:-} && -n ${SLURM_JOB_ID:-} ]]; then
        MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    fi
    MASTER_PORT=${MASTER_PORT:-29500}
    export MASTER_ADDR MASTER_PORT
    # NCCL is left to the site, which knows its fabric: NCCL_SOCKET_IFNAME (bootstrap
    # interface), NCCL_IB_HCA / NCCL_IB_GID_INDEX / NCCL_IB_TIMEOUT (InfiniBand or RoCE),
    # NCCL_DEBUG=INFO (to see the chosen transports). Whatever is exported when the job starts
    # reaches every rank (srun passes the environment on) and is printed with the command.
    # NCCL_NVLS_ENABLE is not set either: on H100/H200 NVSwitch systems NCCL uses NVLink
    # SHARP for in-node all-reduces where available, which reduces in the switch and so
    # occupies fewer SMs next to the GEMMs Domino overlaps; export NCCL_NVLS_ENABLE=0 to
    # compare without it or if its extra memory per communicator is a problem.
}

# recipe_check_domino: the Domino settings the run would refuse at startup, refused here
# first (before srun starts a rank; with DRY_RUN=1, before the job is submitted).
recipe_check_domino() {
    local local_only=()
    if [[ $DOMINO_SPLIT == batch ]] && ((DOMINO_CHUNKS > 1 && MICRO_BATCH_SIZE % DOMINO_CHUNKS)); then
        recipe_die "DOMINO_CHUNKS=$DOMINO_CHUNKS does not divide MICRO_BATCH_SIZE=\
$MICRO_BATCH_SIZE: use a micro-batch that is a multiple of it, or at micro-batch 1 \
DOMINO_SPLIT=sequence (chunks of tokens; any TRANSFORMER_IMPL)."
    fi
    if [[ $TRANSFORMER_IMPL == transformer_engine ]]; then
        ((DOMINO_COLUMN_CHUNKS > 1)) && local_only+=("DOMINO_COLUMN_CHUNKS=$DOMINO_COLUMN_CHUNKS")
        if ((${#local_only[@]})); then
            recipe_die "${local_only[*]} needs Megatron-Core's local layers: add \
TRANSFORMER_IMPL=local (Transformer Engine's are the default)."
        fi
        if ((!SEQUENCE_PARALLEL && DOMINO_BACKWARD_OVERLAP)); then
            recipe_die "with Transformer Engine layers Domino overlaps the backward \
collectives only under sequence parallelism: leave SEQUENCE_PARALLEL=1 (the default), or set \
DOMINO_BACKWARD_OVERLAP=0."
        fi
    fi
    if ((SEQUENCE_PARALLEL && !DOMINO_BACKWARD_OVERLAP)); then
        recipe_die "DOMINO_BACKWARD_OVERLAP=0 is an ablation without sequence parallelism: \
add SEQUENCE_PARALLEL=0 (with TRANSFORMER_IMPL=transformer_engine it is on by default)."
    fi
}

# recipe_hybrid_pattern: MODEL's NUM_LAYERS layers as HybridModel's pattern, '*-' per layer,
# PP segments of NUM_LAYERS / PP layers joined by '|' (e.g. 4 layers on PP 2: '*-*-|*-*-').
recipe_hybrid_pattern() {
    local layers=${MODEL_CFG[NUM_LAYERS]} segment="" pattern="" i
    ((layers % PP == 0)) || recipe_die "MODEL_CLASS=hybrid: $layers layers do not split into PP=$PP equal segments."
    for ((i = 0; i < layers / PP; i++)); do segment+="*-"; done
    for ((i = 0; i < PP; i++)); do pattern+="${pattern:+|}$segment"; done
    echo "$pattern"
}

# recipe_pretrain_args DOMINO RUN_DIR: PRETRAIN_ARGS, the flags of one run, in groups.
recipe_pretrain_args() {
    local domino=$1 run_dir=$2
    # The CPU replacements of Megatron-LM's GPU defaults (as in megatron_domino/training/runs.py): gloo for
    # NCCL, no Apex persistent LayerNorm or fused weight-gradient accumulation, no CUDA fused
    # softmax, no TE fused RoPE. TRANSFORMER_IMPL is local there by default.
    CPU_ARGS=()
    ((CPU)) && CPU_ARGS=(--distributed-backend gloo --no-persist-layer-norm
        --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion)
    GPT_MODEL_ARGS=(
        --num-layers "${MODEL_CFG[NUM_LAYERS]}"
        --hidden-size "${MODEL_CFG[HIDDEN_SIZE]}"
        --ffn-hidden-size "${MODEL_CFG[FFN_HIDDEN_SIZE]}"
        --num-attention-heads "${MODEL_CFG[NUM_ATTENTION_HEADS]}"
        --seq-length "${MODEL_CFG[SEQ_LENGTH]}"
        --max-position-embeddings "${MODEL_CFG[MAX_POSITION_EMBEDDINGS]}"
        --normalization "${MODEL_CFG[NORMALIZATION]}"
        --position-embedding-type "${MODEL_CFG[POSITION_EMBEDDING_TYPE]}"
        --attention-dropout "${MODEL_CFG[ATTENTION_DROPOUT]}"
        --hidden-dropout "${MODEL_CFG[HIDDEN_DROPOUT]}"
        --transformer-impl "$TRANSFORMER_IMPL"
    )
    if [[ ${MODEL_CFG[NUM_QUERY_GROUPS]} -ne ${MODEL_CFG[NUM_ATTENTION_HEADS]} ]]; then
        GPT_MODEL_ARGS+=(--group-query-attention
            --num-query-groups "${MODEL_CFG[NUM_QUERY_GROUPS]}")
    fi
    if [[ -n ${MODEL_CFG[ROTARY_BASE]:-} ]]; then
        GPT_MODEL_ARGS+=(--rotary-base "${MODEL_CFG[ROTARY_BASE]}")
    fi
    [[ ${MODEL_CFG[SWIGLU]} == 1 ]] && GPT_MODEL_ARGS+=(--swiglu)
    [[ ${MODEL_CFG[DISABLE_BIAS_LINEAR]} == 1 ]] && GPT_MODEL_ARGS+=(--disable-bias-linear)
    [[ ${MODEL_CFG[UNTIE_EMBEDDINGS_AND_OUTPUT_WEIGHTS]} == 1 ]] &&
        GPT_MODEL_ARGS+=(--untie-embeddings-and-output-weights)
    # Under SP Domino runs TE's layer with its norms apart (megatron_domino/specs/te_spec.py: the same
    # parameters, checkpoint-compatible); both arms build it, so their weights start equal.
    if [[ $MODEL_CLASS == hybrid ]]; then
        GPT_MODEL_ARGS+=(--hybrid-layer-pattern "$(recipe_hybrid_pattern)")
        # The same layers cut in two (megatron_domino/specs/hybrid_spec.py): TE's norms apart
        # under SP, Megatron's local layers with norms that run without Apex on the CPU.
        if [[ $TRANSFORMER_IMPL == transformer_engine ]] && ((SEQUENCE_PARALLEL)); then
            GPT_MODEL_ARGS+=(--spec megatron_domino.specs.te_hybrid_spec te_norms_apart_hybrid_stack_spec)
        elif [[ $TRANSFORMER_IMPL == local ]]; then
            GPT_MODEL_ARGS+=(--spec megatron_domino.specs.hybrid_spec local_hybrid_stack_spec)
        fi
    elif [[ $TRANSFORMER_IMPL == transformer_engine ]] && ((SEQUENCE_PARALLEL)); then
        GPT_MODEL_ARGS+=(--spec megatron_domino.specs.te_spec te_norms_apart_block_spec)
    fi

    # GPT-3 and Llama-2 both train with AdamW(0.9, 0.95), weight decay 0.1, clipping at 1.0
    # and a cosine schedule to 10 % of the peak learning rate.
    TRAINING_ARGS=(
        --micro-batch-size "$MICRO_BATCH_SIZE"
        --global-batch-size "$GLOBAL_BATCH_SIZE"
        --train-iters "$TRAIN_ITERS"
        --lr "$LR"
        --min-lr "$MIN_LR"
        --lr-decay-style cosine
        --lr-warmup-iters "$LR_WARMUP_ITERS"
        --weight-decay 0.1
        --adam-beta1 0.9
        --adam-beta2 0.95
        --clip-grad 1.0
        --seed "$SEED"
    )
    ((BF16)) && TRAINING_ARGS+=(--bf16)
    # FP8 GEMMs in Transformer Engine's linears (TRANSFORMER_IMPL=transformer_engine).
    [[ -n $FP8_FORMAT ]] && TRAINING_ARGS+=(--fp8-format "$FP8_FORMAT" --fp8-recipe "$FP8_RECIPE")

    # Tensor (and sequence) and pipeline parallelism.
    MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
    # Interleaved pipeline: VP model chunks (virtual stages) per pipeline rank.
    ((VP > 1)) && MODEL_PARALLEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VP")
    ((SEQUENCE_PARALLEL)) && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
    ((DISTRIBUTED_OPTIMIZER)) && MODEL_PARALLEL_ARGS+=(--use-distributed-optimizer)
    ((OVERLAP_GRAD_REDUCE)) && MODEL_PARALLEL_ARGS+=(--overlap-grad-reduce)

    if ((MOCK)); then
        # NullTokenizer: ids 0..VOCAB_SIZE-1 plus one end-of-document id, as in Megatron-LM.
        DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer
            --vocab-size "${MODEL_CFG[VOCAB_SIZE]}")
    else
        local data_path
        read -ra data_path <<<"$DATA_PATH"
        # The vocabulary is the tokenizer's; the model config's VOCAB_SIZE is for MOCK=1 only.
        DATA_ARGS=(--data-path "${data_path[@]}" --split "${SPLIT:-969,30,1}"
            --tokenizer-type "$TOKENIZER_TYPE")
        if [[ $TOKENIZER_TYPE == GPT2BPETokenizer ]]; then
            DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
        else
            DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
        fi
    fi
    [[ -n ${DATA_CACHE_PATH:-} ]] && DATA_ARGS+=(--data-cache-path "$DATA_CACHE_PATH")

    # --log-throughput: Megatron-LM's TFLOP/s/GPU on its iteration lines (its GPT FLOP formula).
    LOGGING_ARGS=(
        --log-interval "$LOG_INTERVAL"
        --log-throughput
        --log-json "$run_dir/log.jsonl"
        --eval-interval "$EVAL_INTERVAL"
        --eval-iters "$EVAL_ITERS"
    )
    [[ -n ${TENSORBOARD_DIR:-} ]] && LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
    CHECKPOINT_ARGS=()
    if [[ -n ${CHECKPOINT_DIR:-} ]]; then
        # Save to and resume from the same directory, as Megatron-LM's examples do; on SIGTERM
        # (SLURM's, before the time limit) every rank finishes its iteration, saves and exits.
        CHECKPOINT_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
            --save-interval "${SAVE_INTERVAL:-1000}" --exit-signal-handler)
    fi

    DOMINO_ARGS=()
    if ((domino)); then
        recipe_check_domino
        DOMINO_ARGS=(--domino --domino-chunks "$DOMINO_CHUNKS"
            --domino-column-chunks "$DOMINO_COLUMN_CHUNKS" --domino-split "$DOMINO_SPLIT")
        ((DOMINO_INTER_LAYER)) || DOMINO_ARGS+=(--no-domino-inter-layer)
        ((DOMINO_BACKWARD_OVERLAP)) || DOMINO_ARGS+=(--no-domino-backward-overlap)
    fi

    # Anything else, appended last (argparse keeps the last value of a repeated flag).
    local extra_args
    read -ra extra_args <<<"${EXTRA_ARGS:-}"

    PRETRAIN_ARGS=("${CPU_ARGS[@]}" "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
        "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${DOMINO_ARGS[@]}"
        "${extra_args[@]}")
    RECIPE_RUN_DIR=$run_dir
}

# recipe_launcher: LAUNCH_CMD, everything before pretrain_gpt_domino.py's flags.
recipe_launcher() {
    # TRAIN_SCRIPT: what the ranks run, pretrain_gpt_domino.py unless a wrapper of it is given
    # (the Slurm tier's TE job: tests/pretrain_te_cpu.py, TE's Python on the CPU).
    local script="${TRAIN_SCRIPT:-$RECIPE_REPO_DIR/pretrain_gpt_domino.py}" srun_args torchrun tasks cpus
    read -ra srun_args <<<"${SRUN_ARGS:-}"
    read -ra torchrun <<<"$TORCHRUN"
    # Give the node's CPUs to its tasks: since SLURM 22.05 a step no longer inherits the job's
    # CPUs per task, so each task would be confined to one CPU - and a torchrun task would run
    # all its ranks on it. Omitted outside a job, or when CPUS_PER_TASK is set empty.
    tasks=$([[ $RECIPE_STYLE == srun ]] && echo "$GPUS_PER_NODE" || echo 1)
    cpus=${CPUS_PER_TASK-${SLURM_CPUS_ON_NODE:+$((SLURM_CPUS_ON_NODE / tasks))}}
    if [[ -n $cpus ]]; then srun_args=(--cpus-per-task="$cpus" "${srun_args[@]}"); fi
    case $RECIPE_STYLE in
    srun)
        # One task per GPU; each rank reads its rank, world size and local rank from SLURM.
        # --ntasks too, here and for torchrun: srun would take the job's SLURM_NTASKS (the
        # #SBATCH 8 per node), more tasks than ranks when the job asked for fewer GPUs, or
        # than nodes for ab_compare.sh's torchrun arm.
        LAUNCH_CMD=(srun --nodes="$NNODES" --ntasks="$WORLD_SIZE" --ntasks-per-node="$GPUS_PER_NODE"
            --kill-on-bad-exit=1 "${srun_args[@]}" "$PYTHON" "$script")
        ;;
    torchrun)
        # One task per node; torchrun starts the node's ranks and the c10d rendezvous on the
        # first node numbers them, so every node runs the identical command. When a rank dies,
        # torchrun restarts all of them (up to MAX_RESTARTS times), and they resume from the
        # latest checkpoint.
        LAUNCH_CMD=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1
            "${srun_args[@]}" "${torchrun[@]}" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
            --max-restarts "$MAX_RESTARTS" --rdzv-id "${SLURM_JOB_ID:-0}" --rdzv-backend c10d
            --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" "$script")
        ;;
    local)
        LAUNCH_CMD=("${torchrun[@]}" --standalone --nproc-per-node "$GPUS_PER_NODE" "$script")
        ;;
    esac
}

# recipe_print LABEL: the resolved environment and command line, runnable as printed.
recipe_print() {
    local name
    echo "# $1: $MODEL_NAME, $NNODES node(s) x $GPUS_PER_NODE ranks, TP=$TP, PP=$PP, DP=$DP ($RECIPE_STYLE)"
    for name in "${RECIPE_EXPORTS[@]}"; do
        printf 'export %s=%q\n' "$name" "${!name}"
    done
    while IFS= read -r name; do
        printf '# inherited: %s=%q\n' "$name" "${!name}"
    done < <(compgen -e | grep -E '^(NCCL_|UCX_|FI_)' || true)
    printf '%q ' "${LAUNCH_CMD[@]}" "${PRETRAIN_ARGS[@]}" | sed 's/ $//'
    echo
}

# recipe_checkpointed_iteration: the iteration of the latest complete checkpoint in
# CHECKPOINT_DIR (Megatron-LM's tracker file, written after every rank's save), 0 if none.
recipe_checkpointed_iteration() {
    local tracker=${CHECKPOINT_DIR:+$CHECKPOINT_DIR/latest_checkpointed_iteration.txt} reached=
    [[ -n $tracker && -f $tracker ]] && reached=$(recipe_positive_int "$(<"$tracker")")
    echo "${reached:-0}"
}

# recipe_refused: whether this attempt's run refused its command line or input, i.e. the
# entry point's one line on rank 0 ("pretrain_gpt_domino.py: error: ...", argparse's too) is
# in the part of RECIPE_LOG that recipe_run wrote this time. Its exit status 2 does not always
# reach the script: srun reports the highest status of its tasks, and a rank that srun
# killed (--kill-on-bad-exit) after another refused is 143; torchrun reports any failure as 1.
recipe_refused() {
    [[ -n ${RECIPE_LOG:-} && -f $RECIPE_LOG ]] || return 1
    # grep -c reads to the end: with grep -q, tail would die of SIGPIPE on a long log, and
    # pipefail would turn the match into a failure.
    local refusals
    refusals=$(tail -c +"$((${RECIPE_LOG_START:-0} + 1))" "$RECIPE_LOG" |
        grep -c '^pretrain_gpt_domino.py: error: ') || true
    ((refusals > 0))
}

# recipe_requeue_unfinished STATUS: after a run that ended with STATUS, put this SLURM job back
# in the queue if training stopped before TRAIN_ITERS for a reason a retry can get past, so
# that it resumes from the latest checkpoint on its own. A requeued job keeps its id, so
# RUN_DIR and CHECKPOINT_DIR stay the same; at most MAX_REQUEUES times (SLURM_RESTART_COUNT
# counts them). Megatron-LM saves when training ends, so a tracker at TRAIN_ITERS means done.
# Requeued: status 0 (the ranks saved and exited early: on a signal, --exit-signal-handler,
# from SLURM's --signal before the time limit or an scancel --signal=TERM; or on
# --exit-duration-in-mins), and any failure after this attempt saved a newer checkpoint (the
# retry starts past the point where it failed). Not requeued: a refused command line or input
# (recipe_refused; the script then exits with the entry point's status 2), and a failure
# before a newer checkpoint, which a retry would repeat (a node lost or a preemption SLURM
# requeues by itself, #SBATCH --requeue). Returns STATUS (2 when refused), or 1 for a stop
# before the end that is not requeued.
recipe_requeue_unfinished() {
    local status=$1 requeues=${SLURM_RESTART_COUNT:-0} reached why
    ((DRY_RUN)) && return 0
    reached=$(recipe_checkpointed_iteration)
    [[ $reached == "$TRAIN_ITERS" ]] && return "$status"
    local stopped="# training stopped at iteration $reached of $TRAIN_ITERS (status $status)"
    if ((status == 2)) || { ((status)) && recipe_refused; }; then
        status=2
        why="the command line or an input was refused; fix it and submit again"
    elif ((status && reached <= ${RECIPE_LAUNCHED_AT:-0})); then
        why="it failed before saving a newer checkpoint than the ${RECIPE_LAUNCHED_AT:-0} it \
started from, and would fail the same way"
    elif [[ -z ${SLURM_JOB_ID:-} || -z ${CHECKPOINT_DIR:-} ]]; then
        why="no SLURM job or no CHECKPOINT_DIR"
    elif ((requeues >= MAX_REQUEUES)); then
        why="requeued $requeues times already (MAX_REQUEUES)"
    else
        echo "$stopped; requeueing job $SLURM_JOB_ID ($((requeues + 1)) of $MAX_REQUEUES)" |
            tee -a "$RUN_DIR/train.log"
        scontrol requeue "$SLURM_JOB_ID" && return 0
        why="scontrol requeue failed"
    fi
    echo "$stopped; not requeued: $why" | tee -a "$RUN_DIR/train.log"
    ((status)) && return "$status"
    return 1
}

# recipe_run LABEL LOG: print the command; unless DRY_RUN=1, run it and tee its output to LOG.
recipe_run() {
    local label=$1 log=$2
    if ((DRY_RUN)); then
        recipe_print "$label"
        return 0
    fi
    mkdir -p "$RECIPE_RUN_DIR" "$(dirname "$log")"
    # Where this attempt starts, in the checkpoints and in the log: recipe_requeue_unfinished
    # asks whether it saved anything new, and recipe_refused reads only this attempt's output.
    RECIPE_LAUNCHED_AT=$(recipe_checkpointed_iteration)
    RECIPE_LOG=$log
    RECIPE_LOG_START=$(stat -c %s "$log" 2>/dev/null || echo 0)
    recipe_print "$label" | tee -a "$log"
    "${LAUNCH_CMD[@]}" "${PRETRAIN_ARGS[@]}" 2>&1 | tee -a "$log"
}
