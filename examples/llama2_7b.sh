#!/usr/bin/env bash
# Pretrain a Llama-2-7B-shaped model (32 layers, hidden 4096, SwiGLU FFN 11008, 32 heads, seq 4096,
# RMSNorm, RoPE, untied embeddings, no biases) with COAT FP8, on the GPUs of one node (8 x 80 GB:
# the distributed optimizer shards the FP32 master weights and COAT's FP8 states over them; add
# --tensor-model-parallel-size 2 --sequence-parallel, or --recompute-granularity selective, if memory is short).
#
#   examples/llama2_7b.sh [more Megatron arguments]                  # mock data
#   DATA_PATH=/data/my_text_document TOKENIZER=meta-llama/Llama-2-7b-hf examples/llama2_7b.sh
#   COAT=0 examples/llama2_7b.sh                                     # the same run in BF16
#
# Environment: GPUS (default: all visible), COAT (1: --coat-fp8, 0: BF16), DATA_PATH (an indexed
# dataset prefix, from Megatron-LM's tools/preprocess_data.py) with TOKENIZER (a Hugging Face
# tokenizer name or path), MICRO_BATCH (default 1), GLOBAL_BATCH (default 1024), ITERS (default 10000).
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
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \
    --seq-length 4096 --max-position-embeddings 4096 \
    --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
    --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights \
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02 \
    --bf16 --transformer-impl "$IMPL" --use-distributed-optimizer --overlap-grad-reduce \
    --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-1024}" --train-iters "${ITERS:-10000}" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    "${DATA[@]}" --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10 \
    "${PRECISION[@]}" "$@"
