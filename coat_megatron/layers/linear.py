"""Column- and row-parallel linears whose GEMMs run in FP8: drop-ins for Megatron's.

They subclass Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``, so construction,
initialisation, parameter names, TP partitioning and checkpointing are Megatron's; only the
forward differs. Tensor parallel: the column-parallel linear splits its output (the input
gradient is all-reduced over the group, BF16); the row-parallel one splits its input and
all-reduces its output in BF16. Under sequence parallelism both run as ``sequence_parallel``'s
linears: the column-parallel input and the row-parallel output gradient are gathered as FP8
codes, each rank's chunk with its own scale, and the gathers and reduce-scatters are split into
chunks that pass from rank to rank while the GEMMs run (``CoatConfig.tp_comm_overlap``).
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

from ..config import CoatConfig
from ..fp8 import Fp8Tensor, OutputForm, fp8_linear, invalidate_weight_caches
from ..fp8.weights import weight_cache_for
from .sequence_parallel import column_parallel_fp8_linear, row_parallel_fp8_linear


def _coat_kwargs(kwargs: dict) -> CoatConfig:
    return kwargs.pop("coat_config", None) or CoatConfig()


def _tag_weight(module) -> None:
    # the weight is read only through per-tensor FP8 quantization in this format: the distributed
    # optimizer may gather it as FP8 codes (coat_megatron.optimizer.param_gather)
    if module.weight is not None:
        module.weight.coat_fp8_format = module.coat.weight_format


def _weights_loaded(module, incompatible_keys) -> None:
    # loaded weights are new values outside an optimizer step: under CUDA graphs only the device
    # generation tells a replayed layer that its FP8 copy is stale
    invalidate_weight_caches()


class CoatColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` with FP8 GEMMs. Input: a per-tensor ``Fp8Tensor`` (from ``CoatNorm``)
    or BF16. Output: BF16, or 1xG FP8 as ``output_form`` says (fc1 feeding SwiGLU: set by ``CoatMLP``)."""

    def __init__(self, input_size, output_size, *args, **kwargs):
        self.coat = _coat_kwargs(kwargs).for_layers(kwargs.get("config"))
        super().__init__(input_size, output_size, *args, **kwargs)
        self.weight_cache = weight_cache_for(self.coat)
        self.register_load_state_dict_post_hook(_weights_loaded)
        _tag_weight(self)
        self.output_form = OutputForm.BF16

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        kwargs = dict(
            config=self.coat,
            weight_cache=self.weight_cache,
            output_form=self.output_form,
            accumulate_into_main_grad=self.gradient_accumulation_fusion or self.coat.fuse_wgrad_accumulation,
        )
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            out = column_parallel_fp8_linear(input_, weight, bias, group=self.tp_group, **kwargs)
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group) if self.allreduce_dgrad else input_
            out = fp8_linear(x, weight, bias, **kwargs)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            if isinstance(out, Fp8Tensor):
                raise ValueError(
                    "an FP8 output cannot be gathered across tensor-parallel ranks; use gather_output=False"
                )
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, self.bias if self.skip_bias_add else None


class CoatRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` with FP8 GEMMs. ``input_saved_by_producer`` (linear_proj after an
    attention that saves its output, as flash attention does): keep that BF16 input for wgrad
    instead of an FP8 transposed copy, so the layer saves nothing the attention has not saved."""

    def __init__(self, input_size, output_size, *args, input_saved_by_producer: bool = False, **kwargs):
        self.coat = _coat_kwargs(kwargs).for_layers(kwargs.get("config"))
        super().__init__(input_size, output_size, *args, **kwargs)
        self.weight_cache = weight_cache_for(self.coat)
        self.register_load_state_dict_post_hook(_weights_loaded)
        _tag_weight(self)
        self.input_saved_by_producer = input_saved_by_producer

    def forward(self, input_):
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        kwargs = dict(
            config=self.coat,
            weight_cache=self.weight_cache,
            save_original_input=self.input_saved_by_producer and not isinstance(x, Fp8Tensor),
            accumulate_into_main_grad=self.gradient_accumulation_fusion or self.coat.fuse_wgrad_accumulation,
        )
        if self.sequence_parallel:
            out = row_parallel_fp8_linear(x, self.weight, group=self.tp_group, **kwargs)
        else:
            out = fp8_linear(x, self.weight, None, **kwargs)
            if self.tp_group is None or self.tp_group.size() > 1:  # one rank: nothing to reduce, no autograd node
                out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None
