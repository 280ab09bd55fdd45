"""The Python API: Megatron's GPTModel with COAT's layer spec and FP8 optimizer, without
megatron.training. Trains a small byte-level GPT on the Python docstring corpus for a few steps.

    python examples/layer_spec.py          (one GPU, or the CPU where there is none)

The COAT-specific lines are the spec (``get_gpt_block_coat_spec``), the DDP layout
(``coat_param_layout``) and the optimizer (``get_coat_optimizer``); everything else is plain
Megatron-Core. On a CPU, ``megatron_on_cpu()`` redirects Megatron's CUDA hard-codes (a no-op with
a GPU).
"""

import os

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from coat_compare.corpus import ByteBatches, stdlib_docstrings
from coat_megatron import CoatConfig
from coat_megatron.optimizer import coat_param_layout, coat_telemetry, get_coat_optimizer
from coat_megatron.spec import get_gpt_block_coat_spec
from coat_patches.cpu import megatron_on_cpu

SEQ, BATCH, STEPS = 128, 8, 30


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return per_token, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})


def main():
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    with megatron_on_cpu():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=128,
            ffn_hidden_size=352,
            num_attention_heads=4,
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            add_bias_linear=False,
            bf16=True,
            params_dtype=torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=not cuda,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
        coat = CoatConfig()  # E4M3 activations in 1x16 groups, E4M3 m and v with range expansion

        # 1. the model: COAT layers in Megatron's GPTModel
        gpt = GPTModel(
            config,
            get_gpt_block_coat_spec(config, coat),
            vocab_size=256,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
        )
        module = Float16Module(config, gpt.to(device))
        # 2. DDP with COAT's layout: no data-parallel shard edge inside a 128-element state group
        # (the recipe says which gradient buffers: BF16 by default, COAT's memory mode)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=coat.ddp_grad_reduce_in_fp32
        )
        model = DistributedDataParallel(
            config, ddp_config, module, full_param_layout=coat_param_layout(module, ddp_config)
        )
        config.finalize_model_grads_func = finalize_model_grads
        # 3. the optimizer: Megatron's distributed optimizer with FP8 AdamW states
        optimizer = get_coat_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=3e-3,
                weight_decay=0.1,
                adam_beta2=0.95,
                clip_grad=1.0,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=True,
            ),
            [model],
            coat,
        )

        data = ByteBatches(stdlib_docstrings(1 << 20), seq_length=SEQ, batch_size=BATCH)
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            batch = {k: v.to(device) for k, v in data.batch(g).items()}
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([batch]),
                model=[model],
                num_microbatches=1,
                seq_length=SEQ,
                micro_batch_size=BATCH,
            )
            optimizer.step()
            if step % 5 == 0:
                print(f"step {step:3d}  loss {losses[0]['lm loss'].item():.3f}", flush=True)
        print(
            f"optimizer state: {optimizer.chained_optimizers[0].optimizer.state_bytes() / 2**20:.2f} MiB "
            f"for {sum(p.numel() for p in gpt.parameters()) / 1e6:.2f}M parameters"
        )
        print("telemetry:", {k: round(v, 4) for k, v in coat_telemetry(optimizer).items()})
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
