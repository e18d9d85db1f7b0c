"""Convert a Hugging Face Llama to the hedgehog window hybrid, then generate with a fixed state.

No download: a tiny ``LlamaForCausalLM`` is built from a config with random weights and first
trained briefly with ``sdpa`` as the teacher (on a synthetic task whose sequences repeat a
random pattern). Then:

1. ``linearize`` switches every attention layer to ``effattn-hedgehog`` with exact softmax over
   the last ``--window`` keys plus a learned feature map over the rest, keeping every weight;
2. ``transfer`` (attention transfer) trains only the new feature maps and window factors so that
   each layer's output matches softmax on the same q, k, v;
3. ``generate()`` with ``RecurrentCache`` decodes with a ring buffer of the window and a
   fixed-size state instead of a growing KV cache.

    python examples/convert_hf_llama.py --threads 1           # ~40 s on one CPU core
    python examples/convert_hf_llama.py --small --threads 1   # a few seconds

Needs ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from effattn.convert import layer_errors, linearize, transfer
from effattn.integrations.transformers import RecurrentCache

VOCAB, PERIOD = 64, 8


def batches(size: int, length: int, generator: torch.Generator):
    """Endless batches of sequences that repeat a random pattern of PERIOD tokens."""
    while True:
        pattern = torch.randint(0, VOCAB, (size, PERIOD), generator=generator)
        yield pattern.repeat(1, length // PERIOD + 1)[:, :length]


def loss_of(model, tokens) -> float:
    with torch.no_grad():
        return model(tokens, labels=tokens).loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the smallest run (for a quick check)")
    p.add_argument("--teacher-steps", type=int, default=None, help="default 150; --small: 20")
    p.add_argument("--transfer-steps", type=int, default=None, help="default 50; --small: 10")
    p.add_argument("--length", type=int, default=None, help="default 128; --small: 48")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    teacher_steps = args.teacher_steps or (20 if args.small else 150)
    transfer_steps = args.transfer_steps or (10 if args.small else 50)
    length = args.length or (48 if args.small else 128)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4 * length, eos_token_id=None, pad_token_id=None,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    data = batches(16, length, torch.Generator().manual_seed(1))
    held_out = next(batches(16, length, torch.Generator().manual_seed(2)))

    # The teacher: the model trained with softmax attention (sdpa).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(teacher_steps):
        loss = model(tokens := next(data), labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    print(f"teacher (sdpa), {teacher_steps} steps: held-out loss {loss_of(model, held_out):.3f}")

    # 1. Swap to the hedgehog window hybrid, every weight kept.
    new = linearize(model, "hedgehog", window=args.window, window_factor=True, decoding=True,
                    seed=0)
    print(f"{model.config._attn_implementation}: {len(new)} new parameter tensors; "
          f"swapped: {loss_of(model, held_out):.3f}; "
          f"layer errors {[round(e, 4) for e in layer_errors(model, held_out)]}")

    # 2. Attention transfer: train only what hedgehog adds, layer by layer against softmax.
    losses = transfer(model, data, steps=transfer_steps, parameters=new)
    print(f"after {transfer_steps} transfer steps: {loss_of(model, held_out):.3f}; "
          f"transfer loss {losses[0]:.3g} -> {losses[-1]:.3g}")

    # 3. Generate with a fixed-size state: a ring buffer of the window plus the linear state.
    prompt = held_out[:1, : 2 * PERIOD]
    cache = RecurrentCache()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                         min_new_tokens=32, do_sample=False, past_key_values=cache)
    expected = held_out[:1, 2 * PERIOD: 2 * PERIOD + 32]
    correct = (out[0, prompt.shape[1]:] == expected[0]).float().mean().item()
    print(f"generated {out.shape[1] - prompt.shape[1]} tokens in a {cache.nbytes() / 1024:.0f} KiB "
          f"state; {100 * correct:.0f}% continue the pattern")


if __name__ == "__main__":
    main()
