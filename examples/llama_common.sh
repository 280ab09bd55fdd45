# Sourced by llama_1b.sh, llama2_7b.sh and llama3_8b.sh: what the recipes share. The caller sets MODEL
# (the shape flags), MICRO_BATCH_DEFAULT, GLOBAL_BATCH_DEFAULT and WARMUP (and, where they differ from
# Llama 2's, ROPE_BASE and VOCAB: the mock data's vocabulary), then runs `launch_llama "$@"`.
#
# Environment: GPUS (default: all visible), TP and PP (tensor- and pipeline-parallel sizes, default 1;
# TP > 1 adds --sequence-parallel; the rest of GPUS is data parallel), MODE (coat: --coat-fp8, the
# default; bf16; te-fp8: TransformerEngine's FP8 with current scaling, the comparison's baseline;
# COAT=0 is MODE=bf16), GRAPHS (te: Megatron's TE-based per-layer CUDA graphs for bf16 and te-fp8,
# their fastest configuration with TE installed; --coat-fp8 picks its graphs itself; under PP the bf16 and
# te-fp8 lines also pass --coat-p2p-sync off, which --coat-fp8 does by default: no device synchronization
# after each pipeline exchange, a gain for every mode, docs/multi-gpu.md),
# DATA_PATH (an indexed dataset prefix, from Megatron-LM's tools/preprocess_data.py) with TOKENIZER
# (a Hugging Face tokenizer name or path), MICRO_BATCH, GLOBAL_BATCH, ITERS (default 10000),
# DRY_RUN=1 (print the command instead of running it).
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

launch_llama() {
    local gpus=${GPUS:-$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")}
    local data impl precision fusion layout
    if [[ -n "${DATA_PATH:-}" ]]; then
        data=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER:?set TOKENIZER with DATA_PATH}")
    else
        data=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB:-32000}")
    fi
    if python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then impl=transformer_engine; else impl=local; fi
    # Megatron's default gradient-accumulation fusion needs apex's fused wgrad kernel
    if python3 -c "import fused_weight_gradient_mlp_cuda" >/dev/null 2>&1; then fusion=(); else fusion=(--no-gradient-accumulation-fusion); fi
    local iters=${ITERS:-10000} warmup=$WARMUP
    if (( iters <= warmup )); then  # Megatron asserts warm-up < decay (train) iterations: a short run warms up over a tenth
        warmup=$(( iters / 10 > 0 ? iters / 10 : 1 ))
        (( iters > warmup )) || { echo "ITERS=$iters: train at least 2 iterations" >&2; return 2; }
        echo "ITERS=$iters is not above the recipe's $WARMUP warm-up iterations: warming up over $warmup (a tenth)" >&2
    fi
    # Adam's epsilon at Llama 2's 1e-5: at Megatron's 1e-8 Llama-2-13B's loss passed ln(vocab) after its
    # warm-up began (benchmarks/results/llama2-13b-1gpu)
    local mode=${MODE:-$([[ "${COAT:-1}" == 1 ]] && echo coat || echo bf16)}
    case $mode in
        coat) precision=(--coat-fp8) ;;
        bf16) precision=() ;;
        te-fp8) precision=(--fp8-format hybrid --fp8-recipe tensorwise) ;;
        *) echo "MODE=$mode: use coat, bf16 or te-fp8" >&2; return 2 ;;
    esac
    case ${GRAPHS:-} in
        "") ;;
        te) [[ $mode == coat ]] || precision+=(--cuda-graph-impl transformer_engine) ;;
        *) echo "GRAPHS=$GRAPHS: use te (or leave it unset: eager, and --coat-fp8's own choice)" >&2; return 2 ;;
    esac
    (( ${PP:-1} > 1 )) && [[ $mode != coat ]] && precision+=(--coat-p2p-sync off)  # as --coat-fp8 runs under PP
    layout=(--tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}")
    (( ${TP:-1} > 1 )) && layout+=(--sequence-parallel)

    local command=(python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" -m coat_patches.launch "$HERE/pretrain_gpt.py"
        "${MODEL[@]}"
        --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear
        --position-embedding-type rope --rotary-base "${ROPE_BASE:-10000}" --untie-embeddings-and-output-weights
        --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02
        --bf16 --transformer-impl "$impl" "${layout[@]}" --use-distributed-optimizer --overlap-grad-reduce "${fusion[@]}"
        --micro-batch-size "${MICRO_BATCH:-$MICRO_BATCH_DEFAULT}" --global-batch-size "${GLOBAL_BATCH:-$GLOBAL_BATCH_DEFAULT}"
        --train-iters "$iters" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$warmup"
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
        "${data[@]}" --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10
        "${precision[@]}" "$@")
    if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "${command[@]}"; echo; return; fi
    exec "${command[@]}"
}
