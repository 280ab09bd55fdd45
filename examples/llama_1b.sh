#!/usr/bin/env bash
# Pretrain a Llama-style 1B model (16 layers, hidden 2048, SwiGLU FFN 5632, 16 heads, seq 2048,
# RMSNorm, RoPE, untied embeddings, no biases) with COAT FP8, on the GPUs of one node.
#
#   examples/llama_1b.sh [more Megatron arguments]                  # mock data
#   DATA_PATH=/data/my_text_document TOKENIZER=meta-llama/Llama-3.2-1B examples/llama_1b.sh
#   COAT=0 examples/llama_1b.sh                                     # the same run in BF16
#
# Environment: GPUS (default: all visible), COAT (1: --coat-fp8, 0: BF16), DATA_PATH (an indexed
# dataset prefix, from Megatron-LM's tools/preprocess_data.py) with TOKENIZER (a Hugging Face
# tokenizer name or path), MICRO_BATCH (default 4), GLOBAL_BATCH (default 256), ITERS (default 10000).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER:?set TOKENIZER with DATA_PATH}")
else
    DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
fi
if python -c "import transformer_engine.pytorch" >/dev/null 2>&1; then IMPL=transformer_engine; else IMPL=local; fi
[[ "${COAT:-1}" == 1 ]] && PRECISION=(--coat-fp8) || PRECISION=()

exec python -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m coat_patches.launch "$HERE/pretrain_gpt.py" \
    --num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
    --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights \
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02 \
    --bf16 --transformer-impl "$IMPL" --use-distributed-optimizer --overlap-grad-reduce \
    --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-256}" --train-iters "${ITERS:-10000}" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    "${DATA[@]}" --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10 \
    "${PRECISION[@]}" "$@"
