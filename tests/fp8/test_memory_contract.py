"""What each FP8 op saves for backward, counted with saved_tensors_hooks
(docs/design.md#data-flow-through-a-layer).

Per token, with hidden H, FFN F and 1xG groups:
    norm       the 1xG FP8 copy of its input + scales + rstd   H (1 + 4/G) + 4
    fc1 / qkv  nothing: the norm output's transposed copy is recomputed in backward from the
               norm's saved copy (transpose="recompute", the layer spec's default), or the FP8
               transposed copy of its input, H, when the norm stores it (transpose="store")
    SwiGLU     its 1xG FP8 input + scales                      2F (1 + 4/G)
    fc2        nothing: its input's transposed copy is recomputed from SwiGLU's saved input
    proj       nothing new when the BF16 input is saved anyway (attention saves its output)
Parameters are excluded (they are not activations); the FP8 weight copies are per-weight caches.
With the accuracy ablations ``norm_input_store="bf16"`` and ``swiglu_input_store="bf16"`` the norm
saves its BF16 input (2H) + rstd and SwiGLU its BF16 input (4F) instead of the 1xG copies.
"""

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from coat_megatron.fp8 import OutputForm, fp8_linear, rmsnorm_to_fp8, swiglu_fp8

T, H, FFN, G = 32, 256, 688, 16


def saved_by(fn, params):
    """Run fn; return its output and the distinct storages it saved for backward (not params)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    unique = {}
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            unique[ptr] = t
    return out, list(unique.values())


def nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def make():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
    wn = torch.ones(H, requires_grad=True)
    w1 = (torch.randn(2 * FFN, H, generator=g) / 16).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(H, FFN, generator=g) / 26).to(torch.bfloat16).requires_grad_()
    return x, wn, w1, w2


def test_each_op_saves_its_contract():
    x, wn, w1, w2 = make()
    params = [wn, w1, w2]
    n, s = saved_by(lambda: rmsnorm_to_fp8(x, wn), params)
    assert sorted(map(str, (t.dtype for t in s))) == sorted(
        map(str, [torch.float8_e4m3fn, torch.float32, torch.float32])
    )
    assert nbytes(s) == T * H + T * H // G * 4 + T * 4
    h, s = saved_by(lambda: fp8_linear(n, w1, output_form=OutputForm.SWIGLU_INPUT), params)
    fp8 = [t for t in s if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 1 and fp8[0].shape == (H, T)  # the wgrad layout: X^T row-major
    assert nbytes(s) == T * H + 4
    n_recompute = rmsnorm_to_fp8(x, wn, transpose="recompute")
    _, s = saved_by(lambda: fp8_linear(n_recompute, w1, output_form=OutputForm.SWIGLU_INPUT), params)
    assert nbytes(s) == 4
    assert h.handoff.consumer_amax is not None  # fc1 found SwiGLU's output amax in its quantizing pass
    a, s = saved_by(lambda: swiglu_fp8(h), params)
    assert nbytes(s) == 2 * T * FFN + 2 * T * FFN // G * 4
    _, s = saved_by(lambda: fp8_linear(a, w2), params)
    assert nbytes(s) == 4  # only the input's scale
    attn_out = torch.randn(T, H).to(torch.bfloat16).requires_grad_()
    _, s = saved_by(lambda: fp8_linear(attn_out, w1, save_original_input=True), params + [attn_out])
    assert nbytes(s) == 8  # amax and scale: the input itself is the caller's


def test_the_bf16_input_stores_save_the_input_itself():
    x, wn, w1, w2 = make()
    params = [wn, w1, w2]
    n, s = saved_by(lambda: rmsnorm_to_fp8(x, wn, input_store="bf16"), params)
    assert nbytes(s) == T * H * 2 + T * 4  # x (BF16) and rstd
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in s)
    h, s = saved_by(lambda: fp8_linear(n, w1), params)  # fc1 writes BF16 for an exact SwiGLU
    assert nbytes(s) == T * H + 4 and not isinstance(h, type(n))
    a, s = saved_by(lambda: swiglu_fp8(h, input_store="bf16"), params)
    assert nbytes(s) == 2 * T * FFN * 2 and s[0].dtype == torch.bfloat16  # h itself
    _, s = saved_by(lambda: fp8_linear(a, w2), params)
    assert nbytes(s) == 4  # its transposed input recomputed from SwiGLU's saved h, as by default


def test_mlp_block_saves_about_a_third_of_bf16():
    x, wn, w1, w2 = make()
    params = [wn, w1, w2]

    def coat():
        return fp8_linear(
            swiglu_fp8(
                fp8_linear(rmsnorm_to_fp8(x, wn, transpose="recompute"), w1, output_form=OutputForm.SWIGLU_INPUT)
            ),
            w2,
        )

    def bf16():
        gate, up = (F.rms_norm(x, (H,), wn.to(torch.bfloat16), 1e-5) @ w1.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2.t()

    _, coat_saved = saved_by(coat, params)
    _, bf16_saved = saved_by(bf16, params + [x])
    coat_bytes = nbytes(coat_saved)
    assert coat_bytes == T * (H * (1 + 4 / G) + 4 + 2 * FFN * (1 + 4 / G)) + 8
    assert all(t.dtype != torch.bfloat16 for t in coat_saved)
    # BF16 saves the norm input (which is x itself here, so excluded), the norm output, fc1's
    # output, silu(gate) and fc2's input: 2H + 4F + 2F + 2F bytes per token (+ rstd)
    assert nbytes(bf16_saved) >= T * (2 * H + 8 * FFN)
    assert coat_bytes <= 0.55 * (nbytes(bf16_saved) + 2 * T * H)


def test_nothing_outside_the_contract_stays_alive():
    """Closures and Fp8Tensors must not keep forward outputs alive: after the block's forward,
    the norm's and SwiGLU's per-tensor FP8 outputs (read only by the next GEMM) are freed."""
    import gc
    import weakref

    x, wn, w1, w2 = make()
    n = rmsnorm_to_fp8(x, wn, transpose="recompute")
    a = swiglu_fp8(fp8_linear(n, w1, output_form=OutputForm.SWIGLU_INPUT))
    refs = [weakref.ref(n.data_fp8), weakref.ref(a.data_fp8)]
    y = fp8_linear(a, w2)
    del n, a
    gc.collect()
    assert all(r() is None for r in refs)
    y.float().sum().backward()  # the recomputed copies still serve the backward
    assert w1.grad is not None and torch.isfinite(w1.grad.float()).all()
