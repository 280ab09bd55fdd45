"""Pretrain a GPT with Megatron's own training loop (``megatron.training.pretrain``).

A standalone counterpart of Megatron-LM's ``pretrain_gpt.py`` that needs only the megatron-core
wheel (0.19 ships ``megatron.training``; the Megatron-LM repository is not needed). The model is
Megatron's ``GPTModel`` built from the command line (``GPTModelConfig``, as 0.19's
``pretrain_gpt.py`` does); the data is one of

- ``--byte-corpus stdlib_docstrings``: the Python standard library's docstrings as bytes
  (``coat_compare.corpus``; real text, nothing downloaded; use ``--vocab-size 256``),
- ``--mock-data``: Megatron's ``MockGPTDataset`` (random tokens),
- ``--data-path``: Megatron's indexed ``GPTDataset`` (``tools/preprocess_data.py`` output).

It knows nothing about COAT: run it through the launcher to get ``--coat-fp8``::

    coat-megatron-run examples/pretrain_gpt.py --num-layers 2 --hidden-size 128 ... --coat-fp8

On a machine without a GPU the launcher runs it on the CPU (gloo); the script itself only has to
put its batches on the device Megatron computes on.
"""

from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

BYTE_CORPORA = ("stdlib_docstrings",)


def add_data_arguments(parser):
    group = parser.add_argument_group(title="examples/pretrain_gpt.py data")
    group.add_argument(
        "--byte-corpus",
        choices=BYTE_CORPORA,
        default=None,
        help="train on a built-in byte-level corpus (coat_compare.corpus) instead of --data-path / --mock-data",
    )
    group.add_argument(
        "--byte-corpus-bytes", type=int, default=4 << 20, help="bytes of the corpus to use (default 4 MiB: all of it)"
    )
    return parser


def byte_corpus_datasets(num_samples, args):
    """Train / validation / test ``ByteWindows`` over the first 90% / next 5% / last 5% of the corpus."""
    from coat_compare.corpus import ByteWindows, stdlib_docstrings

    if get_tokenizer().vocab_size < 256:
        raise ValueError(
            f"--byte-corpus needs a vocabulary of 256 bytes: pass --vocab-size 256 (the tokenizer has {get_tokenizer().vocab_size})"
        )
    data = stdlib_docstrings(args.byte_corpus_bytes)
    cuts = [0, int(0.9 * len(data)), int(0.95 * len(data)), len(data)]
    return [
        ByteWindows(data[lo:hi], args.seq_length, n, seed=args.seed + split) if n else None
        for split, (lo, hi, n) in enumerate(zip(cuts, cuts[1:], num_samples))
    ]


def megatron_datasets(num_samples, args):
    """Megatron's ``GPTDataset`` (``--data-path``) or ``MockGPTDataset`` (``--mock-data``)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # causal attention needs no mask tensor
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, lambda: True, config).build()


def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    """What ``pretrain()`` calls with the number of train / valid / test samples it will draw.

    Under virtual pipeline parallelism ``pretrain()`` calls it once per model chunk of the rank with
    that chunk's ``vp_stage`` (and refuses a provider without the keyword); every chunk reads the same
    datasets, so the stage changes nothing here."""
    args = get_args()
    print_rank_0(f"> building {'the ' + args.byte_corpus + ' byte corpus' if args.byte_corpus else 'GPT'} datasets ...")
    return byte_corpus_datasets(num_samples, args) if args.byte_corpus else megatron_datasets(num_samples, args)


# Every rank builds the (deterministic) datasets and reads its data-parallel share of them.
train_valid_test_datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    """(sum of the masked per-token losses, token count, report): Megatron divides by the count."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def forward_step(data_iterator, model):
    """One micro-batch: the model returns per-token losses when given labels."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    output_tensor = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"]
    )
    return output_tensor, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=add_data_arguments, args_defaults={"tokenizer_type": "NullTokenizer"}
    )
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
