"""A causal LM trained with transformers' Trainer on stallfree's packed token windows.

The model is a tiny Llama built from a config (random weights, nothing downloaded); the data is
any token source ``stallfree.TokenDataset`` reads (a Megatron ``.bin``/``.idx`` prefix, a raw
``.bin`` with ``--dtype``, Arrow/Parquet ``input_ids``). The only change from a stock Trainer
script is the import of ``Trainer`` from ``stallfree.integrations.transformers``.

Run (one node, N processes; CPU works with gloo, GPUs with nccl):

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --data ./tokens.bin --dtype uint16 \
        --out ./run --save-steps 100

Kill it at any time and run the same command again, with any number of processes: it resumes
from the newest checkpoint in ``--out`` and every window is trained on once per epoch (where an
epoch does not split evenly over the processes, its first windows fill the last step, as torch's
``DistributedSampler`` pads).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import stallfree
from stallfree.integrations.transformers import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="token source: Megatron prefix, raw .bin, Arrow/Parquet")
    p.add_argument("--dtype", default=None, help="token dtype of a raw .bin (uint16, uint32, ...)")
    p.add_argument("--out", required=True, help="Trainer output_dir: checkpoints land here")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=50304, help="larger than the largest token id")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes per rank")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_llama(vocab_size: int, seq_len: int, seed: int) -> LlamaForCausalLM:
    """A two-layer Llama with random weights, the same on every rank (DDP checks that)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq_len,
    )
    return LlamaForCausalLM(config)


def build_trainer(args: argparse.Namespace) -> Trainer:
    # labels="inputs": labels equal input_ids, as HF *ForCausalLM expects (it shifts them itself)
    dataset = stallfree.TokenDataset(args.data, args.seq_len, dtype=args.dtype, labels="inputs")
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=10,
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=args.workers,
        use_cpu=not torch.cuda.is_available(),
    )
    model = tiny_llama(args.vocab_size, args.seq_len, args.seed)
    # doc_ids (a TokenDataset field the model does not take) is left out of each batch, as Trainer
    # does for its own loader (remove_unused_columns)
    return Trainer(model=model, args=training, train_dataset=dataset)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trainer = build_trainer(args)
    resume = get_last_checkpoint(args.out) if Path(args.out).is_dir() else None
    trainer.train(resume_from_checkpoint=resume)
    stats = trainer.train_loader.stats()
    print(
        f"rank {stats['rank']}: {stats['batches']} batches, waited for data "
        f"{100 * stats['wait_fraction']:.1f}% of the time",
        flush=True,
    )


if __name__ == "__main__":
    main()
