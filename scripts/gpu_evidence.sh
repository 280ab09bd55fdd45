#!/usr/bin/env bash
# The GPU evidence behind the README's results and docs/results.md, one part per claim still measured
# (a retired study's commands.txt names the commit with its part), each within one 10-minute device
# command; run on the device machine after the staged megatron-core/TE install.
#
#   bash scripts/gpu_evidence.sh PART [ARGS]                      # one part, on the visible GPU
#   bash scripts/gpu_evidence.sh --each-gpu "PART [ARGS]" ...     # parts at once, one per GPU (" + ": one after another)
#   bash scripts/gpu_evidence.sh --each-gpu "NAME=VALUE ... PART [ARGS]" ...  # that part's environment (LIMIT: its seconds; CUDA_VISIBLE_DEVICES=0,1,2: more GPUs)
#   bash scripts/gpu_evidence.sh --help                           # this list
#
# Parts, and the folder of benchmarks/results/ each one measures again:
#   gpu-tests                                    every GPU test (pytest -m gpu)
#   fits-llama2-7b                               Llama-2-7B, global batch 16, on one 80 GB GPU -> llama2-7b-fits-80gb-1gpu
#   max-batch-llama2-7b MODES [START [PER_STEP]]  each mode's largest micro-batch, eager -> llama2-7b-max-batch-1gpu
#   train-llama2-13b [ADAM_EPS]                  Llama-2-13B, micro-batch 2, 150 steps (epsilon 1e-5) -> llama2-13b-1gpu
#   fits-llama2-13b                              Llama-2-13B at micro-batch 1, every recipe and BF16 -> llama2-13b-1gpu
#   default-vs-cached-gpt-1b                     the default against the cached recipes, gpt-1b -> gpt-1b-default-vs-cached-1gpu
#   default-vs-cached-llama2-7b                  the same, Llama-2-7B micro-batch 1 -> llama2-7b-default-vs-cached-1gpu
#   memory-gpt-1b                                bytes per parameter by recipe, gpt-1b -> gpt-1b-memory-by-mode-1gpu
#   speed-gpt-1b                                 gpt-1b, global batch 32, every mode eager and graphed -> gpt-1b-speed-1gpu
#   wgrad-fusion-gpt-1b                          the wgrad added inside the GEMMs or by Megatron -> gpt-1b-speed-1gpu
#   eager-gpt-1b                                 eager gpt-1b, the default against coat-cached -> gpt-1b-eager-1gpu
#   speed-llama2-7b                              Llama-2-7B micro-batch 1, eager and graphed -> llama2-7b-speed-1gpu
#   pretrain-gpt-1b                              --coat-fp8 through Megatron's pretrain() -> pretrain-gpt-1b-1gpu
#   kernel-launches                              kernel launches per layer -> kernel-launches-layer-1gpu
#   layer-llama2-7b                              one layer's time and activations -> layer-llama2-7b-1gpu
#   accuracy-runs PROTOCOL SEEDS [DEADLINE]     an accuracy protocol's runs, PER_DEVICE (8) at once on every GPU, state kept on the machine -> accuracy-gpt-125m-paired-2gpu, accuracy-gpt-1b-check-2gpu
#   fidelity-gpt-1b WHAT [STEP]                  WHAT train, then measure STEP: gradients and update against FP32 from a BF16 run's checkpoints (steps 30, 150, 299) -> gradient-fidelity-1gpu
#   fidelity-llama2-7b-layer                     the same on one Llama-2-7B layer from its initial weights -> gradient-fidelity-1gpu
#   apex-pretrain WHAT                           WHAT build, then run: apex's fused wgrad from the snapshot carried as .apex (build_apex.sh), then BF16, TE FP8 and --coat-fp8 graphed through pretrain(), Megatron's wgrad fusion on and off -> apex-wgrad-fusion-1gpu
#   tp-gpu-tests                                 the TP path's GPU tests and launch counts on 2 GPUs -> layer-llama2-7b-tp2-2gpu
#   layer-llama2-7b-tp2 [MICRO_BATCH]            one layer at TP 2 + SP, COAT's ring against blocking collectives -> layer-llama2-7b-tp2-2gpu
#   speed-llama2-7b-tp2dp2 GRAPHS                Llama-2-7B at TP 2 x DP 2, micro-batch 1, global batch 16 -> llama2-7b-tp2dp2-4gpu
#   layouts-gpt-1b LAYOUTS [MODES]               each layout against one GPU, 30 steps, the layout rule -> layouts-gpt-1b-4gpu
#   step-profile-tp PRESET TP DP MB GB [GRAPHS]  where a TP x DP step's time goes (rank 0), BF16, TE, COAT -> tp2-host-bound-and-graphs-2gpu
#   speed-gpt-1b-tp2 [GRAPHS]                    gpt-1b at TP 2, BF16, TE, COAT, eager and graphed (2 GPUs) -> tp2-host-bound-and-graphs-2gpu
#   pretrain-graphs-tp2 [MODES [GRAPHS]]         pretrain() at TP 2, graphed BF16 and --coat-fp8 alone, and how each run's process groups closed (2 GPUs) -> tp2-host-bound-and-graphs-2gpu
#   pretrain-graphs-pp [LAYOUTS [MODES]]         pretrain() with TE-based graphs under PP, the layout rule against eager (default "one pp2", "bf16-graphs te-fp8-graphs coat coat-auto") -> pretrain-pipeline-4gpu
#   pretrain-layouts LAYOUTS [MODES]             pretrain() per layout (default modes "bf16 te-fp8 coat-auto") -> pretrain-pipeline-4gpu, pipeline-sync-pp2-2gpu
#   pretrain-llama3-8b LAYOUTS [MODES]           examples/llama3_8b.sh through pretrain() per layout (one, tp2, tp2pp2, dp4) and mode -> pretrain-pipeline-4gpu, llama3-8b-fits-one-h200-1gpu, llama3-8b-tp2-2gpu
#   scaling-gpt-1b [MODES [LAYOUTS]]             gpt-1b graphed on 1, 2 and 4 GPUs (DP; LAYOUTS 1,dp2,dp4,dp8 on 8), tokens/s per GPU per mode -> dp-scaling-gpt-1b-4gpu
#   dp4-llama2-7b MB GB [MODES [overlap]]        Llama-2-7B at DP 4, graphed, the FP8 parameter gather beside ("overlap": DDP's overlap flags) -> llama2-7b-dp4-4gpu
#   max-batch-llama2-7b-dp4 MODES [GIB]          each mode's largest micro-batch at DP 4 within GIB (79) per GPU, eager -> llama2-7b-dp4-4gpu
#   llama2-13b-4gpu TP DP MB MODES [GB]          Llama-2-13B on 4 GPUs, graphed, one layout (GB 16) -> llama2-13b-4gpu
#
# The parts from tp-gpu-tests on use several GPUs, one process each (coat-compare starts each run's torchrun
# itself); scripts/gpu_pretrain_layouts.sh runs --coat-fp8 through pretrain() at TP and PP layouts.
#
# A part writes its reports and logs to $OUT/PART/ (default ./out) and packs them as $OUT/PART.tgz
# (the device machine returns a limited number of files). --each-gpu runs argument i on GPU i with
# OUT=$OUT/gpu<i>, stops an argument still running after $LIMIT seconds (default 540) and packs what
# it wrote; its processes share the host, so compare timings only within one part's report.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

each_gpu() {  # "PART [ARGS] [+ PART [ARGS]]" per GPU, all at once
  [ $# -ge 1 ] || { echo "usage: gpu_evidence.sh --each-gpu \"PART [ARGS]\" ... (one per GPU)" >&2; exit 2; }
  local base=${OUT:-out} n i spec
  n=$(nvidia-smi -L | wc -l)
  [ "$n" -ge $# ] || { echo "--each-gpu got $# parts but this machine has $n GPUs: give at most $n" >&2; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
  export COAT_GPU_INSTALLED=1  # installed once here: concurrent installs of one project can race
  mkdir -p "$base"
  i=0
  for spec in "$@"; do
    (
      rest=$spec
      while [ -n "$rest" ]; do
        one=${rest%% + *}
        if [ "$one" = "$rest" ]; then rest=""; else rest=${rest#* + }; fi
        read -ra words <<<"$one"
        envs=(); limit=${LIMIT:-540}
        while [[ ${words[0]:-} =~ ^[A-Z_][A-Z0-9_]*= ]]; do  # NAME=VALUE words: this part's environment
          envs+=("${words[0]}"); [[ ${words[0]} == LIMIT=* ]] && limit=${words[0]#LIMIT=}; words=("${words[@]:1}")
        done
        env CUDA_VISIBLE_DEVICES=$i OUT="$base/gpu$i" "${envs[@]}" timeout -k 5 "$limit" bash "$0" "${words[@]}"
        rc=$?
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "stopped after $limit s (LIMIT): what it wrote is packed"; break; fi
      done
    ) >"$base/gpu$i.txt" 2>&1 &
    i=$((i + 1))
  done
  wait
  shopt -s nullglob
  local dir
  for dir in "$base"/gpu*/*/; do  # a part stopped before packing its folder
    dir=${dir%/}
    [ -f "$dir.tgz" ] || tar czf "$dir.tgz" -C "$dir" .
    rm -rf "$dir"
  done
  i=0
  for spec in "$@"; do echo "=== GPU $i: $spec"; cat "$base/gpu$i.txt"; i=$((i + 1)); done
}

case ${1:-} in
  "" | -h | --help) usage; exit 0 ;;
  --each-gpu) shift; each_gpu "$@"; exit 0 ;;
esac
part=$1
shift
parts() { sed -n '/^# Parts,/,/^# A part writes/p' "$0" | grep -oE '^#   [a-z0-9-]+' | cut -c5-; }
parts | grep -qx -- "$part" || { echo "unknown part $part: bash scripts/gpu_evidence.sh --help lists them" >&2; exit 2; }
out=${OUT:-out}/$part
dest=${OUT:-out}
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup
big=(env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)  # 7B and 13B near the memory limit: fewer fragments
rows() { grep -h -E "^\| ($1) \|" "${@:2}" 2>/dev/null | cut -c1-200; }  # a report's table rows, for the printout

case $part in
  gpu-tests)
    run 580 pytest-gpu python3 -m pytest -q -m gpu -p no:cacheprovider tests
    tail -3 "$out/pytest-gpu.log" ;;
  fits-llama2-7b)
    run 290 llama2-7b-mb4 "${big[@]}" coat-compare --preset llama2-7b --micro-batch 4 --global-batch 16 --steps 5 \
      --modes coat,coat-codes --out "$out" --name llama2-7b-mb4 --no-plots
    run 290 llama2-7b-gb16 "${big[@]}" coat-compare --preset llama2-7b --micro-batch 2 --global-batch 16 --steps 5 \
      --modes coat-codes,bf16,te-fp8-current,te-fp8-pa --out "$out" --name llama2-7b-gb16 --no-plots
    rows "coat|coat-codes|bf16|te-fp8-current|te-fp8-pa" "$out"/llama2-7b-*.md ;;
  max-batch-llama2-7b)
    modes=${1:?max-batch-llama2-7b MODES [START [PER_STEP]]}; start=${2:-1}; per_step=${3:-1}; tag=${modes//,/-}-x$per_step
    n_modes=$(($(tr -cd , <<<"$modes" | wc -c) + 1))
    run 585 "search-$tag" "${big[@]}" coat-compare search --preset llama2-7b --modes "$modes" --search-start "$start" \
      --search-micro-batches "$per_step" --search-time-limit $((540 / n_modes)) --out "$out" --name "llama2-7b-search-$tag" --no-plots
    rows "${modes//,/|}" "$out/llama2-7b-search-$tag.md" ;;
  train-llama2-13b)
    eps=${1:-1e-5}
    run 590 "llama2-13b-eps$eps" "${big[@]}" coat-compare --preset llama2-13b --micro-batch 2 --global-batch 4 --steps 150 \
      --eval-every 25 --eval-windows 48 --adam-eps "$eps" --modes coat --out "$out" --name "llama2-13b-eps$eps-150" --no-plots
    grep -E "^\| (coat|training loss)" "$out/llama2-13b-eps$eps-150.md" | cut -c1-260 ;;
  fits-llama2-13b)
    run 580 llama2-13b-mb1 "${big[@]}" coat-compare --preset llama2-13b --micro-batch 1 --steps 8 \
      --modes coat,coat-codes,coat-fp32,bf16 --out "$out" --name llama2-13b --no-plots
    rows "coat|coat-codes|coat-fp32|bf16" "$out/llama2-13b.md" ;;
  default-vs-cached-gpt-1b)
    run 560 gpt-1b coat-compare --preset gpt-1b --micro-batch 4 --steps 40 --modes bf16,coat,coat-codes,coat-cached \
      --cuda-graphs none,local --out "$out" --name gpt-1b --no-plots
    rows "bf16|coat|coat-codes|coat-cached" "$out/gpt-1b.md" ;;
  default-vs-cached-llama2-7b)
    run 560 llama2-7b "${big[@]}" coat-compare --preset llama2-7b --micro-batch 1 --steps 8 --modes coat,coat-codes,coat-cached \
      --cuda-graphs local --out "$out" --name llama2-7b-default-vs-cached --no-plots
    rows "coat|coat-codes|coat-cached" "$out/llama2-7b-default-vs-cached.md" ;;
  memory-gpt-1b)
    run 580 gpt-1b-memory coat-compare --preset gpt-1b --micro-batch 4 --steps 20 --modes bf16,te-fp8-pa,coat,coat-codes,coat-fp32 \
      --cuda-graphs none,local --out "$out" --name gpt-1b-memory --no-plots
    rows "bf16|te-fp8-pa|coat|coat-codes|coat-fp32" "$out/gpt-1b-memory.md" ;;
  speed-gpt-1b)
    run 570 gpt-1b-fastest coat-compare --preset gpt-1b --micro-batch 4 --global-batch 32 --steps 12 \
      --modes bf16,te-fp8-delayed,te-fp8-current,coat --cuda-graphs none,local --out "$out" --name gpt-1b-fastest --no-plots
    rows "bf16|te-fp8-delayed|te-fp8-current|coat" "$out/gpt-1b-fastest.md" ;;
  wgrad-fusion-gpt-1b)
    common=(--preset gpt-1b --micro-batch 4 --global-batch 32 --steps 12 --cuda-graphs local --out "$out" --no-plots)
    run 220 fused coat-compare "${common[@]}" --modes bf16,te-fp8-delayed,coat --name gpt-1b-fused
    # the same with every mode's wgrad left to Megatron, then COAT's through an FP32 temporary and an add
    run 220 unfused coat-compare "${common[@]}" --wgrad-fusion off --modes bf16,te-fp8-delayed,coat --name gpt-1b-unfused
    run 120 fused-add coat-compare "${common[@]}" --wgrad-accumulate add --modes coat --name gpt-1b-fused-add
    rows "bf16|te-fp8-delayed|coat" "$out"/gpt-1b-*.md ;;
  eager-gpt-1b)
    for gb in 4 32; do
      run 280 "eager-gb$gb" coat-compare --preset gpt-1b --micro-batch 4 --global-batch "$gb" --steps 10 \
        --modes bf16,coat,coat-cached --out "$out" --name "gpt-1b-eager-gb$gb" --no-plots
    done
    rows "bf16|coat|coat-cached" "$out"/gpt-1b-eager-gb*.md ;;
  speed-llama2-7b)
    run 585 llama2-7b-mb1 "${big[@]}" coat-compare --preset llama2-7b --micro-batch 1 --global-batch 8 --steps 8 \
      --modes bf16,te-fp8-current,coat --cuda-graphs none,local --out "$out" --name llama2-7b-mb1 --no-plots
    rows "bf16|te-fp8-current|coat" "$out/llama2-7b-mb1.md" ;;
  pretrain-gpt-1b)
    run 570 pretrain env OUT="$out" GPUS=1 ITERS=30 GLOBAL_BATCH=32 GRAPHS=local PYTHON=python3 \
      bash "$(dirname "$0")/gpu_pretrain.sh"
    cat "$out/comparison.md" ;;
  kernel-launches)
    run 300 lean-path python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/compare/test_lean_layer.py
    grep -E "launches|passed|failed" "$out/lean-path.log" | cut -c1-300 ;;
  layer-llama2-7b)
    run 200 layer coat-compare --preset llama2-7b-layer \
      --modes bf16-local,bf16,te-fp8-delayed,te-fp8-current,te-fp8-block,te-fp8-store,coat,coat-recompute \
      --out "$out" --name llama2-7b-layer --no-plots
    rows "bf16.*|te-fp8.*|coat.*" "$out/llama2-7b-layer.md" ;;
  accuracy-runs)
    # the runs of an accuracy protocol (coat_compare/protocol/) still missing from the committed rows, PER_DEVICE
    # at once on each GPU, none started that would end after DEADLINE seconds; reports and checkpoints stay in
    # $ACCURACY_STATE while the machine is warm, so the next command goes on. No loss is printed: the power
    # gate's sd is the only figure (read blind, coat_compare.protocol).
    name=${1:?accuracy-runs PROTOCOL SEEDS [DEADLINE]}; seeds=${2:?accuracy-runs PROTOCOL SEEDS (e.g. 1-8)}
    state=${ACCURACY_STATE:-$HOME/accuracy-state}
    earlier=(); [ -f "${ACCURACY_ROWS:-}" ] && earlier=("$ACCURACY_ROWS")  # rows of earlier sessions
    python3 -m coat_compare.protocol run "$name" --state "$state" --seeds "$seeds" --deadline "${3:-540}" \
      --per-device "${PER_DEVICE:-8}" --guess-step-s "${GUESS_STEP_S:-0.6}" ${earlier:+--done "${earlier[@]}"} | tee "$out/runs.txt" | tail -4
    python3 -m coat_compare.protocol keep "$state" --into "$out/rows.jsonl"
    python3 -m coat_compare.protocol power "$name" "$state" "${earlier[@]}"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader ;;
  fidelity-gpt-1b)
    # the weights: a BF16 run of gpt-1b-accuracy (300 steps of 32 x 2048, linear to zero) that saves after steps 30,
    # 150 and 299 into $FIDELITY_CKPT (about 14 GB each, kept on the machine); then, per checkpoint, every
    # configuration's gradients and update on the batches that follow it (coat_compare.fidelity)
    ckpt=${FIDELITY_CKPT:-$HOME/fidelity-ckpt}
    case ${1:?fidelity-gpt-1b train | measure STEP} in
      train)
        run 590 train coat-compare --preset gpt-1b-accuracy --modes bf16 --micro-batch 4 --global-batch 32 --steps 300 \
          --lr-warmup-steps 30 --lr-decay linear --lr-min-ratio 0 --eval-every 0 --save "$ckpt" --save-steps 30,150,299 \
          --out "$out" --name train --no-plots
        ls "$ckpt" ;;
      measure)
        step=${2:?fidelity-gpt-1b measure STEP (30, 150 or 299)}
        # 8 sequences as 8 micro-batches of 1: at 2 x 4 the BF16 configuration ran out of an H200's memory (135 GB
        # allocated: the local spec's unfused attention keeps 4 x 16 x 2048^2 scores per layer)
        run 590 "step$step" python3 -m coat_compare.fidelity --preset gpt-1b-accuracy --micro-batch 1 --micro-batches 8 --seed 1234 \
          --load "$ckpt/step$step" --first-step "$step" --out "$out/step$step"
        cat "$out/step$step/fidelity.md" ;;
      *) echo "fidelity-gpt-1b: train, or measure STEP" >&2; exit 2 ;;
    esac ;;
  apex-pretrain)
    # apex is not in the GPU image: build_apex.sh builds its fused weight-gradient extension (the one Megatron's
    # gradient-accumulation fusion calls; about a minute; APEX_EXTENSIONS="" builds every core extension, over 7
    # minutes) from a source snapshot carried with the tree; then each mode graphed through pretrain() with
    # Megatron's fusion on (FUSION=1, which coat-megatron-run keeps where apex's fused wgrad imports) and off
    case ${1:?apex-pretrain build | run} in
      build) run 580 build env APEX_EXTENSIONS="${APEX_EXTENSIONS-fused_weight_gradient_mlp_cuda}" \
               bash "$(dirname "$0")/build_apex.sh" "${APEX_SRC:-.apex}"; tail -3 "$out/build.log" ;;
      run)
        python3 -c "import torch, fused_weight_gradient_mlp_cuda" || { echo "apex is not built: apex-pretrain build" >&2; exit 2; }
        for fusion in 1 0; do
          run 270 "fusion$fusion" env RES="$out/fusion$fusion" OUT="$out/fusion$fusion" LAYOUTS=one \
            MODES="bf16-graphs te-fp8-graphs coat-auto" FUSION=$fusion CAP=200 bash "$(dirname "$0")/gpu_pretrain_layouts.sh"
          grep -h "coat-megatron-run\|gradient_accumulation_fusion \|Traceback\|Error" "$out/fusion$fusion"/*.log | sort | uniq -c | head
          cat "$out/fusion$fusion/summary.md"
        done ;;
      *) echo "apex-pretrain: build, or run" >&2; exit 2 ;;
    esac ;;
  fidelity-llama2-7b-layer)
    run 590 layer "${big[@]}" python3 -m coat_compare.fidelity --preset llama2-7b --layers 1 --micro-batch 2 --out "$out"
    cat "$out/fidelity.md" ;;
  tp-gpu-tests)
    # the TP path's GPU tests, the lean path's kernels and its launch count at TP 2 + SP (-rxs: each xfail's counts)
    run 420 pytest-tp python3 -m pytest -q -rxs -m gpu -p no:cacheprovider tests/megatron/test_sequence_parallel.py \
      tests/megatron/test_layer_launches.py tests/kernels/test_per_tensor.py tests/kernels/test_norm.py tests/fp8/test_norm_main_grad.py tests/fp8/test_ops.py \
      tests/fp8/test_chunked_transposes.py tests/megatron/test_graphed_coat_layer.py tests/compare/test_lean_layer.py
    grep -hE "^rank [01]: |XFAIL|FAILED|passed|failed" "$out/pytest-tp.log" | cut -c1-300 ;;
  layer-llama2-7b-tp2)
    mb=${1:-4}
    run 400 "layer-tp2-mb$mb" coat-compare --preset llama2-7b-layer --tp 2 --micro-batch "$mb" \
      --modes bf16,te-fp8-current,coat,coat-tp-ring --out "$out" --name "llama2-7b-layer-tp2-mb$mb" --no-plots
    rows "bf16|te-fp8-current|coat|coat-tp-ring" "$out/llama2-7b-layer-tp2-mb$mb.md" ;;
  speed-llama2-7b-tp2dp2)
    graphs=${1:?speed-llama2-7b-tp2dp2 none|local}
    run 560 "tp2dp2-$graphs" "${big[@]}" coat-compare --preset llama2-7b --tp 2 --dp 2 --micro-batch 1 --global-batch 16 \
      --steps 8 --modes bf16,te-fp8-current,coat --cuda-graphs "$graphs" --step-timeout 150 --run-timeout 180 --out "$out" \
      --name "llama2-7b-tp2dp2-$graphs" --no-plots
    rows "bf16|te-fp8-current|coat" "$out/llama2-7b-tp2dp2-$graphs.md" ;;
  layouts-gpt-1b)
    layouts=${1:?layouts-gpt-1b LAYOUTS [MODES]}; modes=${2:-bf16,coat}; tag=${layouts//,/-}
    run 585 "layouts-$tag" coat-compare layouts "$layouts" --preset gpt-1b --modes "$modes" --micro-batch 2 \
      --global-batch 8 --steps 30 --step-timeout 150 --run-timeout 170 --out "$out" --name "gpt-1b-layouts-$tag" --no-plots
    rows "${modes//,/|}" "$out/gpt-1b-layouts-$tag.md" ;;
  step-profile-tp)
    preset=${1:?step-profile-tp PRESET TP DP MB GB [GRAPHS]}; tp=$2; dp=$3; mb=$4; gb=$5; graphs=${6:-none}
    run 560 "step-$preset-tp$tp-dp$dp-$graphs" "${big[@]}" python3 benchmarks/step_profile.py --preset "$preset" --tp "$tp" --dp "$dp" \
      --micro-batch "$mb" --global-batch "$gb" --modes bf16,te-fp8-current,coat --cuda-graphs "$graphs" --steps 2 --config-timeout 180 --out "$out"
    grep -E "^\| (bf16|te-fp8-current|coat) " "$out/step_profile.md" ;;
  speed-gpt-1b-tp2)
    graphs=${1:-none,local}
    NCCL_DEBUG=WARN run 520 "gpt-1b-tp2" coat-compare --preset gpt-1b --tp 2 --micro-batch 2 --global-batch 8 --steps 8 \
      --modes bf16,te-fp8-current,coat --cuda-graphs "$graphs" --step-timeout 120 --run-timeout 150 --out "$out" \
      --name gpt-1b-tp2-speed --no-plots
    rows "bf16|te-fp8-current|coat" "$out/gpt-1b-tp2-speed.md"
    grep -rhE "row made|released|leaving|teardown|Timeout" "$out" 2>/dev/null | cut -c1-200 | tail -30 ;;
  pretrain-graphs-tp2)
    # each graphed run's rank 0 then says how many CUDA graphs the launcher released and how long the process
    # groups took to close; a destroy past 15 s says "leaving without them" and names its group. GRAPHS
    # transformer_engine: the -graphs modes take Megatron's TE-based graphs (coat-auto keeps its own choice)
    modes=${1:-bf16-graphs coat-auto}; graphs=${2:-local}
    RES="$out" OUT="$out" LAYOUTS=tp2 MODES="$modes" GRAPHS="$graphs" CAP=${CAP:-120} \
      bash scripts/gpu_pretrain_layouts.sh >"$out/layouts.txt" 2>&1
    python3 -c "import torch; print('torch', torch.__version__, 'NCCL', '.'.join(map(str, torch.cuda.nccl.version())))"
    cat "$out/summary.md"; grep -H "coat-megatron-run" "$out"/*.log | sed "s|^$out/||" | cut -c1-240 ;;
  pretrain-graphs-pp)
    # under PP the -graphs modes and coat-auto (--coat-fp8 alone) take Megatron's TE-based graphs; coat (eager)
    # and the summary's largest loss difference from layout "one" check that the graphed COAT trains like eager
    layouts=${1:-one pp2}; modes=${2:-bf16-graphs te-fp8-graphs coat coat-auto}  # then "pp2vp2" and "tp2pp2" alone
    RES="$out" OUT="$out" LAYOUTS="$layouts" MODES="$modes" CAP=${CAP:-120} \
      bash scripts/gpu_pretrain_layouts.sh >"$out/layouts.txt" 2>&1
    cat "$out/summary.md"; grep -h "coat-megatron-run" "$out"/*.log | sort | uniq -c | cut -c1-200 ;;
  pretrain-layouts)
    layouts=${1:?pretrain-layouts LAYOUTS [MODES]}; modes=${2:-bf16 te-fp8 coat-auto}
    RES="$out" OUT="$out" LAYOUTS="$layouts" MODES="$modes" CAP=${CAP:-150} \
      bash scripts/gpu_pretrain_layouts.sh >"$out/layouts.txt" 2>&1
    cat "$out/summary.md"; grep -h "coat-megatron-run" "$out"/*.log | sort | uniq -c | cut -c1-200 ;;
  pretrain-llama3-8b)
    # examples/llama3_8b.sh itself through pretrain() per mode (mock data, 12 iterations), rows.jsonl beside
    layouts=${1:?pretrain-llama3-8b LAYOUTS [MODES]}; modes=${2:-bf16 bf16-graphs te-fp8 te-fp8-graphs coat coat-auto}
    RES="$out" OUT="$out" SIZE=llama3-8b ITERS=${ITERS:-12} LAYOUTS="$layouts" MODES="$modes" CAP=${CAP:-240} \
      bash scripts/gpu_pretrain_layouts.sh >"$out/layouts.txt" 2>&1
    cat "$out/summary.md"; grep -h "coat-megatron-run" "$out"/*.log | sort | uniq -c | cut -c1-200 ;;
  scaling-gpt-1b)
    modes=${1:-bf16,te-fp8-current,coat}; layouts=${2:-1,dp2,dp4}
    run 570 scaling coat-compare layouts "$layouts" --preset gpt-1b --modes "$modes" --micro-batch 4 --global-batch 32 \
      --steps 8 --cuda-graphs local --step-timeout 120 --run-timeout 150 --out "$out" --name gpt-1b-dp-scaling --no-plots
    rows "${modes//,/|}" "$out/gpt-1b-dp-scaling.md" ;;
  dp4-llama2-7b)
    mb=${1:?dp4-llama2-7b MB GB [MODES [overlap]]}; gb=${2:?dp4-llama2-7b MB GB [MODES [overlap]]}
    modes=${3:-bf16,te-fp8-current,coat,coat-fp8-gather}; overlap=()
    [ "${4:-}" = overlap ] && overlap=(--overlap-grad-reduce --overlap-param-gather)
    name="llama2-7b-dp4-mb$mb${4:+-$4}"
    run 570 "dp4-mb$mb${4:+-$4}" "${big[@]}" coat-compare --preset llama2-7b --dp 4 --micro-batch "$mb" --global-batch "$gb" \
      --steps 6 --modes "$modes" --cuda-graphs local "${overlap[@]}" --step-timeout 150 --run-timeout 200 --out "$out" \
      --name "$name" --no-plots
    rows "${modes//,/|}" "$out/$name.md" ;;
  max-batch-llama2-7b-dp4)
    modes=${1:?max-batch-llama2-7b-dp4 MODES [GIB]}; gib=${2:-79}; n_modes=$(($(tr -cd , <<<"$modes" | wc -c) + 1))
    run 585 "search-dp4-${modes//,/-}" "${big[@]}" coat-compare search --preset llama2-7b --dp 4 --modes "$modes" \
      --search-micro-batches 4 --fit-memory "$gib" --search-time-limit $((540 / n_modes)) --out "$out" \
      --name "llama2-7b-dp4-search-${modes//,/-}" --no-plots
    rows "${modes//,/|}" "$out/llama2-7b-dp4-search-${modes//,/-}.md" ;;
  llama2-13b-4gpu)
    tp=${1:?llama2-13b-4gpu TP DP MB MODES [GB]}; dp=${2:?}; mb=${3:?}; modes=${4:?}; gb=${5:-16}
    name="llama2-13b-tp$tp-dp$dp-mb$mb"
    run 570 "$name" "${big[@]}" coat-compare --preset llama2-13b --tp "$tp" --dp "$dp" --micro-batch "$mb" \
      --global-batch "$gb" --steps 5 --modes "$modes" --cuda-graphs local --step-timeout 150 --run-timeout 260 \
      --out "$out" --name "$name" --no-plots
    rows "${modes//,/|}" "$out/$name.md" ;;
  *) echo "part $part is listed in the header but has no branch here" >&2; exit 2 ;;
esac
packed=$(mktemp "/tmp/$part.XXXXXX")  # one per process: --each-gpu runs a part on several GPUs at once
tar czf "$packed" -C "$out" . && mv "$packed" "$dest/$part.tgz"
