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
# Environment: see llama_common.sh (MICRO_BATCH default 1, GLOBAL_BATCH default 1024).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/llama_common.sh"
MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
       --seq-length 4096 --max-position-embeddings 4096)
MICRO_BATCH_DEFAULT=1 GLOBAL_BATCH_DEFAULT=1024 WARMUP=2000
launch_llama "$@"
