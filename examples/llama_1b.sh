#!/usr/bin/env bash
# Pretrain a Llama-style 1B model (16 layers, hidden 2048, SwiGLU FFN 5632, 16 heads, seq 2048,
# RMSNorm, RoPE, untied embeddings, no biases) with COAT FP8, on the GPUs of one node.
#
#   examples/llama_1b.sh [more Megatron arguments]                  # mock data
#   DATA_PATH=/data/my_text_document TOKENIZER=meta-llama/Llama-3.2-1B examples/llama_1b.sh
#   COAT=0 examples/llama_1b.sh                                     # the same run in BF16
#
# Environment: see llama_common.sh (MICRO_BATCH default 4, GLOBAL_BATCH default 256).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/llama_common.sh"
MODEL=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
       --seq-length 2048 --max-position-embeddings 2048)
MICRO_BATCH_DEFAULT=4 GLOBAL_BATCH_DEFAULT=256 WARMUP=500
launch_llama "$@"
