"""Switch a torch Transformer to hedgehog with a window and train it.

A small decoder-only language model built from ``torch.nn.TransformerEncoder`` (causal mask)
learns a synthetic task: each sequence repeats a random pattern, so from the second repeat on
every token is predictable from the one a period back. ``effattn.nn.swap`` replaces every
``nn.MultiheadAttention`` by effattn's with ``hedgehog`` (a learned feature map) plus exact
softmax over the last ``--window`` keys, keeping every weight; the model then trains as any torch
model does.

    python examples/swap_torch.py --threads 1            # ~30 s on one CPU core
    python examples/swap_torch.py --small --threads 1    # a few seconds
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from effattn.nn import swap


class TinyLM(nn.Module):
    """Embedding, a causal stack of torch's encoder layers, a linear head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(length, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.stack = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.stack(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(x)


def batch(size: int, length: int, vocab: int, period: int, generator: torch.Generator):
    pattern = torch.randint(0, vocab, (size, period), generator=generator)
    return pattern.repeat(1, length // period + 1)[:, :length]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the smallest run (for a quick check)")
    p.add_argument("--steps", type=int, default=None, help="default 100; --small: 20")
    p.add_argument("--length", type=int, default=None, help="default 128; --small: 64")
    p.add_argument("--window", type=int, default=16, help="exact softmax over the last W keys")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 on a busy machine)")
    args = p.parse_args()
    steps = args.steps or (20 if args.small else 100)
    length = args.length or (64 if args.small else 128)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab, period = 32, 8

    torch.manual_seed(0)
    model = TinyLM(vocab, d_model=64, heads=4, layers=2, length=length)
    swap(model, "hedgehog", window=args.window, seed=0)   # every attention layer, weights kept
    layers = sum(type(m).__name__ == "MultiheadAttention" for m in model.modules())
    print(f"{layers} attention layers now hedgehog with window={args.window}")

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    start, losses = time.time(), []
    for step in range(1, steps + 1):
        tokens = batch(16, length, vocab, period, generator)
        logits = model(tokens[:, :-1])
        # Score the predictable part: every token after the first period.
        loss = nn.functional.cross_entropy(logits[:, period - 1:].reshape(-1, vocab),
                                           tokens[:, period:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, steps // 5) == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - start:.1f} s)")
    chance = torch.log(torch.tensor(float(vocab))).item()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (chance: {chance:.3f})")


if __name__ == "__main__":
    main()
