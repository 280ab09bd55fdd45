"""The lean hot path on a GPU: one fwd+bwd of a COAT layer launches no more kernels than the same
layer with TransformerEngine's FP8 (current scaling), and copies nothing from the device to the host.
(COAT's CPU-side part, no tensor-subclass dispatch: tests/megatron/test_lean_path.py.)"""

from __future__ import annotations

import contextlib

import pytest

from coat_compare.modes import MODES, unavailable_reason
from coat_compare.presets import Preset

# a small Llama-shaped layer: 256 tokens, so that the kernels are short and the counts, not the
# times, are what the test reads
SMALL = Preset("lean-layer", "layer", layers=1, hidden=256, ffn=704, heads=4, seq=128, micro_batch=2)


@pytest.fixture
def megatron_on_one_gpu():
    from coat_compare import parallel

    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        parallel.seed_everything(1234)
        yield


@pytest.mark.gpu
def test_a_coat_layer_launches_no_more_kernels_than_te_fp8(megatron_on_one_gpu):
    from coat_compare.layer import LayerStep, kernel_launches

    reason = unavailable_reason(MODES["te-fp8-current"], "layer")
    if reason:
        pytest.skip(reason)
    counts = {}
    for mode in ("coat", "te-fp8-current"):
        run = LayerStep(SMALL, MODES[mode], 1234)

        def step(run=run):
            run.step()
            run.clear_grads()

        counts[mode] = kernel_launches(step)
    coat, te = (sum(counts[m].values()) for m in ("coat", "te-fp8-current"))
    print(f"kernel launches per fwd+bwd: coat {coat}, te-fp8-current {te}")
    print("coat:", dict(counts["coat"].most_common()))
    assert coat <= te, (coat, te, counts["coat"].most_common())
    copies_to_host = {k: n for k, n in counts["coat"].items() if "DtoH" in k or "Device -> Host" in k}
    assert not copies_to_host, copies_to_host
