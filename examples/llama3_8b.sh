#!/usr/bin/env bash
# Pretrain a Llama-3-8B-shaped model (32 layers, hidden 4096, SwiGLU FFN 14336, 32 heads in 8 query
# groups, seq 8192, RoPE base 500000, vocabulary 128256, RMSNorm, untied embeddings, no biases) with
# COAT FP8 on the GPUs of one node, beside the BF16 and TE FP8 runs it is compared with. Layouts: TP 2
# (tensor parallel with sequence parallelism; --coat-fp8 turns Megatron's per-layer graphs on), TP 2 x
# PP 2 (--coat-fp8 picks Megatron's TE-based graphs under PP where TransformerEngine is installed), or
# data parallel over all GPUs. Micro-batch 1; the distributed optimizer overlaps its gradient
# reduction and parameter gather with compute.
#
#   GPUS=2 TP=2 examples/llama3_8b.sh                          # COAT, TP 2
#   GPUS=4 TP=2 PP=2 examples/llama3_8b.sh                     # COAT, TP 2 x PP 2
#   GPUS=4 examples/llama3_8b.sh                               # COAT, DP 4
#   GPUS=4 TP=2 PP=2 MODE=bf16 GRAPHS=te examples/llama3_8b.sh     # BF16 beside it, with its fastest graphs
#   GPUS=4 TP=2 PP=2 MODE=te-fp8 GRAPHS=te examples/llama3_8b.sh   # TE FP8 (current scaling) beside it
#   DATA_PATH=/data/my_text_document TOKENIZER=meta-llama/Meta-Llama-3-8B examples/llama3_8b.sh
#   DRY_RUN=1 GPUS=4 TP=2 PP=2 examples/llama3_8b.sh           # print the command
#
# Environment: see llama_common.sh (MICRO_BATCH default 1, GLOBAL_BATCH default 8: raise it for
# training; the comparison's figures use 8).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/llama_common.sh"
MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
       --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192
       --overlap-param-gather)
MICRO_BATCH_DEFAULT=1 GLOBAL_BATCH_DEFAULT=8 WARMUP=2000 ROPE_BASE=${ROPE_BASE:-500000} VOCAB=${VOCAB:-128256}
launch_llama "$@"
