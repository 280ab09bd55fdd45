#!/usr/bin/env bash
# coat-compare's te-fp8-pa diverges (gpt-1b: loss 10.5 -> 129 in 30 steps on an H100). This
# reproduces it with Megatron's own training loop and Megatron's own arguments: examples/pretrain_gpt.py
# (plain megatron.training.pretrain) started by coat-megatron-run WITHOUT --coat-fp8, so that of ours
# only the packaging fix applies (the megatron-core wheel ships the compiled dataset helpers but not
# their Makefile, and a bare start fails in `make`: patches/wheel.py), the gpt-1b shape, TE FP8
# current scaling, and
#   --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8
# next to controls that change one thing each. Data: coat-compare's corpus (Python standard-library
# docstrings, byte tokens, so 256 of the 32000 vocabulary entries occur), or DATA=mock.
#
#   scripts/gpu_pa_repro.sh                      # the five runs below, about 1 minute each on an H100
#   RUNS="pa-fp8 pa-fp8-vocab256" scripts/gpu_pa_repro.sh
#
# Runs (each --train-iters $ITERS, lr 3e-4 after a 10-step linear warm-up, then constant, as
# coat-compare; betas 0.9/0.95, wd 0.1, clip 1.0, micro-batch 4 x seq 2048). What each should do if
# the cause is the per-tensor FP8 second moment (benchmarks/pa_optimizer_emulation.py):
#   pa-fp8           FP8 m, FP8 v: coat-compare's te-fp8-pa                          diverges
#   pa-fp8-v-bf16    FP8 m, BF16 v                                                   trains like no-pa
#   pa-bf16-v-fp8    BF16 m, FP8 v                                                   diverges
#   no-pa            FP32 m and v: coat-compare's te-fp8-current                     trains
#   pa-fp8-vocab256  pa-fp8 with --vocab-size 256: 149 never-seen output rows, not   trains (or spikes
#                    31893, so the output layer's gradients span far fewer octaves   much later)
#
# Environment: OUT (default ./out; per run NAME.log, and losses.md with the loss of every
# iteration), RUNS, ITERS (default 30), DATA (bytes | mock), PYTHON (default python).
# TE FusedAdam's FP8-state path loops over parameters in Python (aminmax + requantize per tensor),
# so the pa runs step ~3x slower than no-pa; the five runs take about 6 minutes (each is cut at
# 150 s). Nothing here is ours but the data (examples/pretrain_gpt.py --byte-corpus, a torch
# Dataset of the same bytes coat-compare trains on).
set -euo pipefail

OUT=${OUT:-./out}
ITERS=${ITERS:-30}
DATA=${DATA:-bytes}
PYTHON=${PYTHON:-python}
RUNS=${RUNS:-"pa-fp8 pa-fp8-v-bf16 pa-bf16-v-fp8 no-pa pa-fp8-vocab256"}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case "$DATA" in
    bytes) DATA_ARGS=(--byte-corpus stdlib_docstrings) ;;
    mock)  DATA_ARGS=(--mock-data) ;;
    *)     echo "DATA=$DATA: use bytes or mock" >&2; exit 2 ;;
esac

# gpt-1b (coat_compare/presets.py) in Megatron's arguments
COMMON=(
    --num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
    --untie-embeddings-and-output-weights --bf16 --attention-dropout 0 --hidden-dropout 0
    --transformer-impl transformer_engine --use-distributed-optimizer --no-gradient-accumulation-fusion
    --fp8-format hybrid --fp8-recipe tensorwise
    --micro-batch-size 4 --global-batch-size 4 --train-iters "$ITERS"
    --lr 3e-4 --min-lr 3e-4 --lr-decay-style constant --lr-warmup-iters 10 --lr-warmup-init 0
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --seed 1234
    "${DATA_ARGS[@]}" --tokenizer-type NullTokenizer --num-workers 1
    --log-interval 1 --eval-iters 0 --eval-interval 1000000
)

run_flags() {  # the arguments each run adds
    case "$1" in
        pa-fp8)          echo "--vocab-size 32000 --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8" ;;
        pa-fp8-v-bf16)   echo "--vocab-size 32000 --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype bf16" ;;
        pa-bf16-v-fp8)   echo "--vocab-size 32000 --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype fp8" ;;
        no-pa)           echo "--vocab-size 32000" ;;
        pa-fp8-vocab256) echo "--vocab-size 256 --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8" ;;
        *) echo "unknown run $1: use pa-fp8, pa-fp8-v-bf16, pa-bf16-v-fp8, no-pa or pa-fp8-vocab256" >&2; return 2 ;;
    esac
}

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
    echo "ITERS=$ITERS DATA=$DATA RUNS=$RUNS"
    "$PYTHON" -c "import torch, megatron.core, transformer_engine; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| TransformerEngine', transformer_engine.__version__, '|', torch.cuda.get_device_name())"
} | tee "$OUT/setup.txt"

for name in $RUNS; do
    flags=$(run_flags "$name")
    echo "=== $name: $flags"
    start=$(date +%s)
    set +e
    # shellcheck disable=SC2086  # $flags is a list of arguments
    timeout 150 "$PYTHON" -m coat_patches.launch "$ROOT/examples/pretrain_gpt.py" \
        "${COMMON[@]}" $flags >"$OUT/$name.log" 2>&1
    status=$?
    set -e
    { grep -E "iteration +[0-9]+/" "$OUT/$name.log" || true; } \
        | sed -E 's/.*iteration +([0-9]+)\/.*lm loss: ([0-9.E+-]+).*grad norm: ([0-9.a-z]+).*/  \1 loss \2 grad norm \3/' | tail -n 6
    echo "$name: exit $status after $(( $(date +%s) - start )) s"
    if (( status != 0 )); then tail -n 20 "$OUT/$name.log"; fi
done

# One table: the loss of every iteration, one column per run
"$PYTHON" - "$OUT" $RUNS <<'EOF' | tee "$OUT/losses.md"
import re, sys
out, runs = sys.argv[1], sys.argv[2:]
pattern = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.Ee+-]+)")
losses = {}
for run in runs:
    try:
        text = open(f"{out}/{run}.log").read()
    except OSError:
        text = ""
    losses[run] = {int(i): float(v) for i, v in pattern.findall(text)}
steps = sorted({i for d in losses.values() for i in d})
print("| iteration | " + " | ".join(runs) + " |")
print("|---|" + "---|" * len(runs))
for i in steps:
    print(f"| {i} | " + " | ".join(f"{losses[r][i]:.3f}" if i in losses[r] else "-" for r in runs) + " |")
EOF
