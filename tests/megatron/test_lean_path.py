"""The lean hot path: what a COAT layer's fwd+bwd costs the host.

- CPU (real Megatron-Core on gloo): FP8 activations pass between COAT's ops without one call of
  ``Fp8Tensor.__torch_dispatch__`` (no tensor-subclass dispatch on the hot path: the ops unpack the
  codes and scales themselves), at TP 1 and at TP 2 with sequence parallel (FP8 all-gathers).
- GPU: one fwd+bwd of a COAT layer launches no more kernels than the same layer with
  TransformerEngine's FP8 (current scaling), and copies nothing from the device to the host.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from distributed import run_distributed

from coat_compare.modes import MODES, unavailable_reason
from coat_compare.presets import Preset

# a small Llama-shaped layer: 256 tokens, so that on a GPU the kernels are short and the counts,
# not the times, are what the test reads
SMALL = Preset("lean-layer", "layer", layers=1, hidden=256, ffn=704, heads=4, seq=128, micro_batch=2)


def _count_dispatch(mode: str, tp: int) -> dict:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from coat_compare.layer import LayerStep
    from coat_megatron.fp8.tensor import Fp8Tensor

    model_parallel_cuda_manual_seed(1234)
    run = LayerStep(SMALL, MODES[mode], 1234, tp=tp)
    run.step()  # the first step builds the FP8 weight copies
    run.clear_grads()
    calls: Counter = Counter()
    made = [0]
    saved = {name: Fp8Tensor.__dict__[name] for name in ("__torch_dispatch__", "__new__")}

    def counting_dispatch(cls, func, types, args=(), kwargs=None):
        calls[str(func)] += 1
        return saved["__torch_dispatch__"].__func__(cls, func, types, args, kwargs)

    def counting_new(cls, *args, **kwargs):
        made[0] += 1
        return saved["__new__"].__func__(cls, *args, **kwargs)

    Fp8Tensor.__torch_dispatch__ = classmethod(counting_dispatch)
    Fp8Tensor.__new__ = staticmethod(counting_new)
    try:
        run.step()
        run.clear_grads()
    finally:
        for name, attribute in saved.items():
            setattr(Fp8Tensor, name, attribute)
    return {"dispatch": dict(calls), "made": made[0]}


@pytest.mark.parametrize("mode", ["coat", "coat-codes", "coat-cached"])
def test_a_coat_layer_step_makes_no_tensor_subclass_dispatch(mode):
    got = run_distributed(_count_dispatch, 1, args=(mode, 1), tensor_parallel=1)[0]
    # FP8 activations do travel between the ops (else this test would check nothing) ...
    assert got["made"] >= 2, got
    # ... and none of them ever reaches torch's dispatcher as a subclass
    assert got["dispatch"] == {}, got


def test_a_sequence_parallel_coat_layer_step_makes_no_tensor_subclass_dispatch():
    ranks = run_distributed(_count_dispatch, 2, args=("coat", 2), tensor_parallel=2)
    for got in ranks:
        assert got["made"] >= 3 and got["dispatch"] == {}, got


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
