#!/usr/bin/env bash
# Megatron's own training loop (examples/pretrain_gpt.py through coat-megatron-run under torchrun)
# in several parallel layouts, BF16 against --coat-fp8, eager and with per-layer CUDA graphs.
# The model is scripts/gpu_pretrain.sh's 1b shape (16 layers, hidden 2048, SwiGLU FFN 5632,
# 16 heads, seq 2048, RMSNorm, RoPE), micro-batch 4, global batch 16, 20 iterations, mock data.
# SIZE=llama3-8b runs examples/llama3_8b.sh itself (its shape and flags, mock data, ITERS iterations),
# each layout's and mode's flags after its own.
# Each layout runs on TP x PP x DP GPUs:
#   one     no parallelism: the reference of each mode's losses  1 GPU
#   pp2     PP 2                                           2 GPUs
#   pp2vp2  PP 2 with 2 virtual stages per rank            2 GPUs
#   tp2     TP 2 + sequence parallel                       2 GPUs
#   tp2pp2  TP 2 x PP 2 + sequence parallel                4 GPUs
#   dp2     DP 2 (where --coat-fp8 alone turns graphs on)  2 GPUs
#   dp4     DP 4                                           4 GPUs
# Modes: bf16 (TE's layers when TE imports, else Megatron's local ones), bf16-graphs, te-fp8 (TE FP8
# with current scaling: --fp8-format hybrid --fp8-recipe tensorwise; needs TE), te-fp8-graphs, te-fp8-pa (te-fp8
# with Megatron's precision-aware optimizer keeping FP8 Adam states: --use-precision-aware-optimizer
# --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8), te-fp8-pa-graphs, coat
# (--coat-fp8 --coat-cuda-graphs off), coat-graphs (--coat-fp8 with graphs), coat-auto (--coat-fp8
# alone: what a user gets); +nosync, +sync and +gc after a mode add --coat-p2p-sync off (no device synchronization
# after each pipeline exchange; --coat-fp8's default), --coat-p2p-sync on (Megatron's default: coat-auto+sync is
# --coat-fp8 as before that default) and --manual-gc --manual-gc-interval 10 (coat-auto+sync+gc). The -graphs modes pass --cuda-graph-impl local, or transformer_engine
# under PP (where megatron-core 0.19's local graphs do not run). Logs go to $RES/LAYOUT-MODE.log; every call then rewrites
# $RES/summary.md and rows.jsonl (scripts/pretrain_summary.py) from the logs in $RES (earlier calls' too): tokens/s (median of the iterations
# after the first half), peak memory per rank (Megatron's report after the last iteration), ratio
# to BF16, the logged loss first and last, and its largest difference from the same mode's run in
# layout "one" at the same logged iterations (the same seed, data and global batch); and copies the
# logs and summary to $OUT. Only DP layouts start from one GPU's weights: Megatron seeds pipeline
# stage s with seed + 100 s and draws each TP partition from its own RNG, so a PP or TP layout trains
# another draw of the model, and its difference from "one" includes that. Judge COAT's difference
# against BF16's in the same layout (coat-compare layouts initializes every layout alike).
#
#   LAYOUTS="pp2" bash scripts/gpu_pretrain_layouts.sh           # one layout's 4 modes: ~6 min
#   LAYOUTS="dp2" MODES="bf16 coat-auto" bash scripts/gpu_pretrain_layouts.sh
#   SIZE=tiny LAYOUTS=tp2 MODES="bf16 coat" bash scripts/gpu_pretrain_layouts.sh   # on a CPU too
#
# Environment: RES (default /tmp/pretrain-layouts), OUT (default out), LAYOUTS (default "pp2 tp2 tp2pp2"), MODES
# (default "bf16 bf16-graphs coat coat-graphs"), GRAPHS (local | transformer_engine: the -graphs modes' graphs in
# every layout, instead of each layout's own), ITERS (default 20), CAP (seconds per run, default
# 150: a run that stalls is stopped and its row says so; 20 s before, each of its ranks writes its Python
# stacks to $RES/stacks-LAYOUT-MODE/coat-stacks-rankN.txt: COAT_STACKS_AFTER), SIZE (1b | llama3-8b | tiny), FUSION (0: pass
# --no-gradient-accumulation-fusion, see scripts/gpu_pretrain.sh; 1: leave Megatron's default, which needs apex).
set -uo pipefail
out=${RES:-/tmp/pretrain-layouts}
dest=${OUT:-out}
iters=${ITERS:-20}
log_interval=$(( iters % 5 == 0 ? 5 : 1 ))  # Megatron wants the memory report's interval (iters) a multiple of it
cap=${CAP:-150}
case ${GRAPHS:-local} in local | transformer_engine) ;; *) echo "GRAPHS=$GRAPHS: use local or transformer_engine" >&2; exit 2 ;; esac
source "$(dirname "$0")/gpu_lib.sh"
if command -v nvidia-smi >/dev/null; then gpu_setup; else mkdir -p "$out" "$dest"; export PYTHONUNBUFFERED=1; fi
root=$(cd "$(dirname "$0")/.." && pwd)

case "${SIZE:-1b}" in
  1b)   model=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
               --seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 --micro-batch-size 4
               --global-batch-size 16 --num-workers 2) ;;
  llama3-8b) recipe=examples/llama3_8b.sh; model=() ;;  # the recipe itself: its shape and flags, mock data
  tiny) model=(--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
               --seq-length 64 --max-position-embeddings 64 --vocab-size 256 --micro-batch-size 2
               --global-batch-size 4 --num-workers 0) ;;
  *)    echo "SIZE=${SIZE:-}: use 1b, llama3-8b or tiny" >&2; exit 2 ;;
esac
if python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then impl=transformer_engine; else impl=local; fi
common=("${model[@]}" --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --bf16 --attention-dropout 0 --hidden-dropout 0
  --transformer-impl "$impl" --use-distributed-optimizer
  --train-iters "$iters" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1
  --clip-grad 1.0 --adam-beta2 0.95 --seed 1234 --mock-data --tokenizer-type NullTokenizer
  --log-interval "$log_interval" --log-throughput --log-memory-interval "$iters" --eval-iters 0 --eval-interval 1000000)
[ "${FUSION:-0}" = 1 ] || common+=(--no-gradient-accumulation-fusion)  # FUSION=1: Megatron's default (apex's fused wgrad)

for layout in ${LAYOUTS:-pp2 tp2 tp2pp2}; do
  case $layout in
    one)    gpus=1; parallel=() ;;
    pp2)    gpus=2; parallel=(--pipeline-model-parallel-size 2) ;;
    pp2vp2) gpus=2; parallel=(--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2) ;;
    tp2)    gpus=2; parallel=(--tensor-model-parallel-size 2 --sequence-parallel) ;;
    tp2pp2) gpus=4; parallel=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel) ;;
    dp2)    gpus=2; parallel=() ;;
    dp4)    gpus=4; parallel=() ;;
    *) echo "layout $layout: use one, pp2, pp2vp2, tp2, tp2pp2, dp2 or dp4" >&2; exit 2 ;;
  esac
  # each mode's graphs as they run there: Megatron's local per-layer graphs do not run under PP
  # (megatron-core 0.19), its TE-based ones do (what --coat-fp8 alone picks there)
  case " ${parallel[*]} " in *" --pipeline-model-parallel-size "*) graphs=transformer_engine ;; *) graphs=local ;; esac
  graphs=${GRAPHS:-$graphs}
  for mode in ${MODES:-bf16 bf16-graphs coat coat-graphs}; do
    options=""; [[ $mode == *+* ]] && options=${mode#*+}
    case ${mode%%+*} in
      bf16)        flags=(--cuda-graph-impl none) ;;
      bf16-graphs) flags=(--cuda-graph-impl "$graphs") ;;
      coat)        flags=(--coat-fp8 --coat-cuda-graphs off) ;;
      coat-graphs) flags=(--coat-fp8 --cuda-graph-impl "$graphs") ;;
      te-fp8 | te-fp8-graphs | te-fp8-pa | te-fp8-pa-graphs)
        [ "$impl" = transformer_engine ] || { echo "mode $mode needs TransformerEngine: install it, or drop the mode" >&2; exit 2; }
        flags=(--fp8-format hybrid --fp8-recipe tensorwise --cuda-graph-impl "$([[ ${mode%%+*} == *-graphs ]] && echo "$graphs" || echo none)")
        if [[ ${mode%%+*} == te-fp8-pa* ]]; then  # stock Megatron's leanest optimizer: FP8 Adam states (TE FusedAdam)
          flags+=(--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8)
        fi ;;
      coat-auto)   flags=(--coat-fp8) ;;
      *) echo "mode $mode: use bf16, bf16-graphs, te-fp8, te-fp8-graphs, te-fp8-pa, te-fp8-pa-graphs, coat, coat-graphs or coat-auto" >&2; exit 2 ;;
    esac
    for option in ${options//+/ }; do
      case $option in
        nosync) flags+=(--coat-p2p-sync off) ;;
        sync)   flags+=(--coat-p2p-sync on) ;;
        gc)     flags+=(--manual-gc --manual-gc-interval 10) ;;
        *) echo "mode $mode: options after + are nosync, sync and gc" >&2; exit 2 ;;
      esac
    done
    # a run still going 20 s before its cap writes each rank's stacks (coat_patches.launch), then is stopped
    if [ -n "${recipe:-}" ]; then  # the recipe's command with this layout, mode and logging after its own flags
      command=(env GPUS="$gpus" MODE=bf16 ITERS="$iters" bash "$root/$recipe" --log-interval "$log_interval"
               --log-memory-interval "$iters" --eval-iters 0 --eval-interval 1000000 "${parallel[@]}" "${flags[@]}")
    else
      command=(python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" -m coat_patches.launch
               "$root/examples/pretrain_gpt.py" "${common[@]}" "${parallel[@]}" "${flags[@]}")
    fi
    COAT_STACKS_AFTER=$((cap > 40 ? cap - 20 : cap / 2)) COAT_STACKS_DIR="$out/stacks-$layout-$mode" \
      run "$cap" "$layout-$mode" "${command[@]}"
    grep -hE "coat-megatron-run: |iteration +$iters/" "$out/$layout-$mode.log" | cut -c1-200
    if compgen -G "$out/stacks-$layout-$mode/*.txt" >/dev/null; then  # where each rank waited: the main thread's
      for f in "$out/stacks-$layout-$mode"/*.txt; do  # innermost frames (faulthandler lists the oldest thread last)
        echo "   ${f##*/}: $(awk '/most recent call first/ {n = 0; top = ""; next} n < 3 && /File/ {top = top $0 ";"; n++} END {print top}' "$f" | tr -s ' ')"
      done
    fi
  done
done

python3 "$root/scripts/pretrain_summary.py" "$out" | tee "$out/summary.md"  # and $out/rows.jsonl
if [ "$(realpath -m "$out")" != "$(realpath -m "$dest")" ]; then  # RES=OUT (the evidence parts): written in place
  cp "$out"/*.log "$out"/summary.md "$out"/rows.jsonl "$dest"/
  for stacks in "$out"/stacks-*/; do [ -d "$stacks" ] && cp -r "$stacks" "$dest"/; done
  [ -f "$out/gpu.txt" ] && cp "$out/gpu.txt" "$dest"/
fi
true
