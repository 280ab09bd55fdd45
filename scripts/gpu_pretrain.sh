#!/usr/bin/env bash
# A ~1B Llama-style GPT (16 layers, hidden 2048, SwiGLU FFN 5632, 16 heads, seq 2048, RMSNorm,
# RoPE, untied embeddings, BF16, mock data) trained for 50 iterations with Megatron's own training
# loop (examples/pretrain_gpt.py through coat-megatron-run), first in BF16 (TransformerEngine's
# layer spec when TE imports, else the local one), then with --coat-fp8; then the comparison table
# (loss, tokens/s, bytes saved for backward, optimizer-state bytes, peak memory).
#
#   scripts/gpu_pretrain.sh                 # on the GPUs of this machine (GPUS=all of them)
#   SIZE=tiny scripts/gpu_pretrain.sh       # a tiny model: a smoke test, also on a CPU
#
# (--no-gradient-accumulation-fusion: Megatron's default needs apex's fused wgrad kernel, absent on a
# plain torch + TE install. COAT's linears still add their wgrad into main_grad inside the GEMM
# (--coat-fuse-wgrad-accumulation, default on); the BF16 run's TE linears then leave the add to
# Megatron, which on gpt-1b cost TE 2.6% of its speed in coat-compare (benchmarks/results/gpt-1b-speed-1gpu):
# read the BF16 ratio with that in mind, or give both runs apex.)
# Environment: OUT (default ./out: logs, --coat-report JSONs, comparison.md), SIZE (1b | tiny),
# GPUS (processes; default: the visible GPUs, or 1), ITERS (default 50), PYTHON (default python),
# GLOBAL_BATCH (sequences per iteration; default micro-batch x GPUS: more accumulates micro-batches),
# GRAPHS (Megatron's --cuda-graph-impl for both runs: none (default), local, full_iteration).
# Megatron prints the loss, iteration time and TFLOP/s every 5 iterations (--log-throughput) and
# its memory report after the first 5. Both runs together take a few minutes on one H100.
set -euo pipefail

OUT=${OUT:-./out}
SIZE=${SIZE:-1b}
ITERS=${ITERS:-50}
PYTHON=${PYTHON:-python}
GRAPHS=${GRAPHS:-none}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${GPUS:-}" ]]; then
    GPUS=$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi

case "$SIZE" in
    1b)   MODEL=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
                 --seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000)
          MICRO_BATCH=4 ;;
    tiny) MODEL=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
                 --seq-length 64 --max-position-embeddings 64 --vocab-size 256)
          MICRO_BATCH=2 ;;
    *)    echo "SIZE=$SIZE: use 1b or tiny" >&2; exit 2 ;;
esac

if "$PYTHON" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then IMPL=transformer_engine; else IMPL=local; fi

COMMON=(
    "${MODEL[@]}" --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
    --untie-embeddings-and-output-weights --bf16 --attention-dropout 0 --hidden-dropout 0
    --transformer-impl "$IMPL" --use-distributed-optimizer --no-gradient-accumulation-fusion
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "${GLOBAL_BATCH:-$((MICRO_BATCH * GPUS))}" --train-iters "$ITERS"
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters $(( ITERS >= 20 ? ITERS / 10 : 1 )) --weight-decay 0.1 --clip-grad 1.0
    --adam-beta2 0.95 --seed 1234
    --mock-data --tokenizer-type NullTokenizer --num-workers 2
    --log-interval 5 --log-throughput --eval-iters 0 --eval-interval 1000000
)

case "$GRAPHS" in
    none) COMMON+=(--cuda-graph-impl none) ;;  # said, or --coat-fp8 would turn on graphs for COAT only
    local) COMMON+=(--cuda-graph-impl local) ;;
    full_iteration) COMMON+=(--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad) ;;
    *) echo "GRAPHS=$GRAPHS: use none, local or full_iteration" >&2; exit 2 ;;
esac

if (( GPUS > 1 )); then
    LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m coat_patches.launch)
else
    LAUNCH=("$PYTHON" -m coat_patches.launch)
fi

mkdir -p "$OUT"
echo "SIZE=$SIZE GPUS=$GPUS ITERS=$ITERS transformer-impl=$IMPL cuda-graph-impl=$GRAPHS -> $OUT" | tee "$OUT/setup.txt"
"$PYTHON" -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$OUT/setup.txt"

for mode in bf16 coat; do
    flags=()
    [[ $mode == coat ]] && flags=(--coat-fp8)
    echo "=== $mode ==="
    start=$(date +%s)
    set +e
    "${LAUNCH[@]}" "$ROOT/examples/pretrain_gpt.py" "${COMMON[@]}" "${flags[@]}" --coat-report "$OUT/$mode.json" 2>&1 \
        | tee "$OUT/$mode.log" | grep -E "iteration +[0-9]+/|memory \(MB\)|coat-megatron-run|Traceback|Error:"
    status=${PIPESTATUS[0]}
    set -e
    echo "$mode: exit $status after $(( $(date +%s) - start )) s"
    if (( status != 0 )); then echo "the $mode run failed: see $OUT/$mode.log" >&2; exit "$status"; fi
done

"$PYTHON" -m coat_patches.report "$OUT/bf16.json" "$OUT/coat.json" | tee "$OUT/comparison.md"
