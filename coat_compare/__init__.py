"""Comparison jobs: BF16, TransformerEngine FP8 and COAT on the same model, data and seed (docs/compare.md).

One module per concept, in the order the ``coat-compare`` command uses them:

    cli.py       the command line: the sub-commands and their options, checked before any work (Options)
    job.py       the command: each sub-command (run, search, resume, layouts, summarize, protocol) as a job
                 whose rows come from its module's measure, kept as they come; the report; the exit status
    run.py       run: each mode in each CUDA graph configuration; one run of a job in its own processes (--probe)
    presets.py   the model shapes (one layer, or a GPT trained end to end)
    modes.py     the recipes compared (bf16, te-fp8-*, coat) and why one cannot run here
    parallel.py  device, torch.distributed and Megatron's parallel state (TP x PP x DP processes)
    build.py     the layer / GPTModel + DDP + optimizer of a mode, same weights for every mode
    layer.py     per-layer measurement: fwd+bwd time, activation memory
    train.py     end-to-end training: loss, step time, tokens/s, memory by part
    memory.py    what weights, gradients, optimizer states and activations occupy
    comm.py      bytes moved by all-gathers, by process group (sequence parallel, DP) and width
    checkpoint.py  Megatron dist checkpoints of the model and its distributed optimizer
    probe.py     one run of a job: its row's identity, its command line, in fresh processes (torchrun for several)
    search.py    search: the largest micro-batch that fits (doubling, bisection, a process per try)
    resume.py    resume: a checkpoint written at DP n resumed at DP 1 and DP n, against the uninterrupted run
    layouts.py   layouts: one model in several parallel layouts, step by step against the first (the rule)
    progress.py  a progress line on stderr
    goals.py     the issue's goals judged on the rows
    report.py    JSON lines and markdown tables with ratios
    plots.py     PNG plots (optional matplotlib)

Beside the command, each its own ``python -m``:

    protocol/    the accuracy protocols and their rule (paired seeds, a one-sided t bound, the blind power
                 gate); runner.py packs a protocol's runs several per GPU within a command's deadline
    fidelity.py  where a recipe's error comes from: gradients and one update against FP32, same weights and batch
"""
