"""One Llama-2-7B transformer layer (hidden 4096, FFN 11008, 32 heads, seq 2048, micro-batch 4,
TP=1) in every mode, in one run: fwd+bwd time and activation memory, as ratios.

    python benchmarks/layer.py [--seq 2048 --micro-batch 4] [--modes ...] [--out DIR]

The measurement lives in ``coat_compare`` (``coat-compare --preset llama2-7b-layer``);
this script runs it with every per-layer mode: Megatron local spec BF16, TE spec BF16, TE FP8
(delayed, current, block scaling), TE FP8 current + ``activation_func_fp8_input_store``, the COAT
spec and COAT with norm outputs recomputed for wgrad. Writes llama2-7b-layer.{md,jsonl,png} to
--out. Any other coat-compare option passes through (e.g. ``--preset llama3-8b-layer``).
"""

import sys

from coat_compare.job import main

MODES = "bf16-local,bf16,te-fp8-delayed,te-fp8-current,te-fp8-block,te-fp8-store,coat,coat-recompute"

if __name__ == "__main__":
    sys.exit(main(["--preset", "llama2-7b-layer", "--modes", MODES, *sys.argv[1:]]))
