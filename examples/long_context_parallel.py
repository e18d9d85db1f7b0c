"""Sequence-parallel training: each sequence split across processes, the same run as one process.

A decoder LM (``effattn.nn.DecoderLM`` with ``performer`` attention) trains on sequences that
repeat a random pattern. Under ``torchrun`` every process holds one contiguous slice of every
sequence: ``split_sequences`` makes each attention layer exchange the kernelized state across
the processes (a few hundred KiB per layer, whatever the length), the rest of the model is
per token, and the parameters' gradients are summed over the processes. Memory per process
falls as N / P, so a sequence too long for one process fits across several.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/long_context_parallel.py                  # gloo on the CPU, ~30 s
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/long_context_parallel.py --small          # a few seconds
    python examples/long_context_parallel.py --small       # one process, the same numbers

Rank 0 prints the loss of the whole batch at each logged step; run it with one process and
with two: the losses agree up to rounding. ``effattn train --sequence-parallel`` does all of
this for the built-in tasks (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from effattn.distributed.training import launched, split_sequences
from effattn.nn import DecoderLM

VOCAB, PERIOD = 32, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the smallest run (for a quick check)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default 2048; "
                   "--small: 256)")
    p.add_argument("--steps", type=int, default=None, help="default 30; --small: 5")
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()
    length = args.length or (256 if args.small else 2048)
    steps = args.steps or (5 if args.small else 30)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    with launched("cpu", sequence_parallel="WORLD_SIZE" in os.environ) as world:
        # The same seed on every rank: the same initial weights and random features everywhere.
        torch.manual_seed(0)
        model = DecoderLM(VOCAB, d_model=64, num_heads=4, num_layers=2, method="performer",
                          max_len=length + 1, num_features=64, seed=0)
        if world.distributed:
            split_sequences(model, total_length=length, group=world.group)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(1)   # every rank draws the same batches
        if world.is_main:
            print(f"{world.size} process(es), {world.mode}: sequences of {length} tokens, "
                  f"{length // world.size} per process")
        for step in range(1, steps + 1):
            pattern = torch.randint(0, VOCAB, (args.batch_size, PERIOD), generator=generator)
            tokens = pattern.repeat(1, length // PERIOD + 2)[:, : length + 1]
            inputs, targets, offset = world.sequence_part(tokens[:, :-1], tokens[:, 1:])
            logits = model(inputs, offset)
            # This rank's share of the loss over the whole batch: sum over its tokens / all.
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                   reduction="sum") / (args.batch_size * length)
            opt.zero_grad()
            loss.backward()
            world.sum_gradients(model.parameters())     # sequence parallel: sum over ranks
            opt.step()
            total = world.sum(loss)
            if world.is_main and (step == 1 or step % max(1, steps // 5) == 0):
                print(f"step {step:3d}  loss {total.item():.4f}")


if __name__ == "__main__":
    main()
