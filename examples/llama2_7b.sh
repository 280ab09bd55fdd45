#!/usr/bin/env bash
# Pretrain a Llama-2-7B-shaped model (32 layers, hidden 4096, SwiGLU FFN 11008, 32 heads, seq 4096,
# RMSNorm, RoPE, untied embeddings, no biases) with COAT FP8, on the GPUs of one node: the
# distributed optimizer shards COAT's master weights (the BF16 weight's low int16 word by default)
# and FP8 Adam states over the data-parallel ranks. Layouts: data parallel over all GPUs (default),
# or TP=2 (tensor parallel with sequence parallelism: half the weights and activations per GPU) x DP.
#
#   examples/llama2_7b.sh [more Megatron arguments]                  # data parallel, mock data
#   GPUS=4 TP=2 examples/llama2_7b.sh                                # TP 2 x DP 2
#   examples/llama2_7b.sh --coat-fp8-param-gather on                 # the DP weight gather in FP8 (slow links)
#   DATA_PATH=/data/my_text_document TOKENIZER=meta-llama/Llama-2-7b-hf examples/llama2_7b.sh
#   COAT=0 examples/llama2_7b.sh                                     # the same run in BF16
#   DRY_RUN=1 GPUS=4 TP=2 examples/llama2_7b.sh                      # print the command
#
# Environment: see llama_common.sh (MICRO_BATCH default 1, GLOBAL_BATCH default 1024).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/llama_common.sh"
MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
       --seq-length 4096 --max-position-embeddings 4096)
MICRO_BATCH_DEFAULT=1 GLOBAL_BATCH_DEFAULT=1024 WARMUP=2000
launch_llama "$@"
