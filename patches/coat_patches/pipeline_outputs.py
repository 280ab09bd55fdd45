"""Pipeline parallelism with Megatron's per-layer CUDA graphs: a stage output that is a view is pseudo-freed too.

Under pipeline parallelism Megatron frees each stage's forward output once it is sent
(``schedules.deallocate_output_tensor``: ``out.data`` replaced by one element; the backward then
needs only its autograd node). That function asserts the output is no view ("counter-productive to
free a view of another tensor"). With ``--cuda-graph-impl local`` the last layer of a stage runs as
a recorded or replayed graph, whose output reaches the schedule as a view of the graph's static
buffer, so in megatron-core 0.19 every PP run with per-layer graphs stops at its first micro-batch,
BF16 (TE layers) and ``--coat-fp8`` alike (measured on 4 x H200 at TP 2 x PP 2; fixed upstream
after 0.19 by making that output viewless, Megatron-LM pull request 6168).

The patch pseudo-frees a view as Megatron frees any other output: its ``.data`` becomes one
element, which the backward's ``custom_backward`` asserts (it runs the autograd engine from the
output's node, whose shape it no longer checks). That frees no memory, because a view's memory
belongs to the tensor it views (here the graph's pool, which stays allocated for the replays), and
it leaves that tensor untouched. A run without graphs frees exactly what it did.

Past that assertion, graph creation stops at ``assert fwd_buffer_reuse_ref_count == 0`` (measured
on 4 x H200 at PP 2 and TP 2 x PP 2, BF16 and COAT alike). The likely cause, from Megatron's code:
``RotaryEmbedding.forward`` is ``lru_cache``d, so every micro-batch hands its layers the same RoPE
tensor. Under PP each micro-batch in flight has its own graphs, so that one tensor is an input of
every layer's graph of every micro-batch; Megatron keeps one shared capture buffer for it until its
last use. That last use is a forward graph of a later micro-batch, made after the first backward
graph, which asserts that no forward buffer is held. So under pipeline parallelism the patch hands
each call its own copy of the cached table (sequence x head dim values, once per micro-batch): each
micro-batch's buffer is then released within its own forward. On GPUs (PP 2, 4 x H200) that gets
graph creation past the assertion and the first iteration done, but the first replay then hangs,
BF16 and COAT alike (benchmarks/results/pretrain-pipeline-4gpu), so ``--coat-fp8`` still refuses
per-layer graphs under PP, unless ``COAT_PIPELINE_GRAPHS=1`` is set (to debug that hang).
"""

from __future__ import annotations

from .replacements import Replacements
from .version import require_megatron_core


def install(replacements: Replacements) -> None:
    """Replace ``megatron.core.pipeline_parallel.schedules.deallocate_output_tensor`` (called by
    name from the schedules in that module, and recursively from itself) and
    ``RotaryEmbedding.forward`` (a copy per call under pipeline parallelism)."""
    require_megatron_core(__name__)
    import torch
    from megatron.core.pipeline_parallel import schedules

    deallocate = schedules.deallocate_output_tensor

    def deallocate_output_tensor_views_too(out, deallocate_pipeline_outputs=False):
        if deallocate_pipeline_outputs and isinstance(out, torch.Tensor) and out._base is not None:
            # a view of a CUDA graph's output buffer: the buffer keeps its memory and its values
            out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
            return
        deallocate(out, deallocate_pipeline_outputs)

    replacements.replace(schedules, "deallocate_output_tensor", deallocate_output_tensor_views_too)

    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cached = RotaryEmbedding.forward  # functools.lru_cache over (self, arguments)

    def forward_a_copy_per_call_under_pp(self, *args, **kwargs):
        emb = cached(self, *args, **kwargs)
        pipelined = (
            parallel_state.model_parallel_is_initialized()
            and parallel_state.get_pipeline_model_parallel_world_size() > 1
        )
        return emb.clone() if pipelined and isinstance(emb, torch.Tensor) else emb

    forward_a_copy_per_call_under_pp.cache_clear = cached.cache_clear  # what subclasses call on it
    forward_a_copy_per_call_under_pp.cache_info = cached.cache_info
    replacements.replace(RotaryEmbedding, "forward", forward_a_copy_per_call_under_pp)
