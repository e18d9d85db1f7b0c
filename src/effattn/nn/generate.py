"""Autoregressive generation with a decoding state: prefill the prompt, then one step per token.

Every layer carries its mechanism's own state (:class:`~effattn.nn.models.DecoderState`): a KV
cache for softmax, a fixed-size (S, z) for kernelized methods, a window for ``local``. The prompt
goes through the parallel (chunkwise) path once; each new token then costs one ``step``, whose
price for kernelized methods does not depend on the position.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from effattn.nn.models import DecoderLM, EncoderDecoder


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens (B,) from logits (B, V): argmax when ``temperature == 0``, else a sample of
    softmax(logits / temperature), restricted to the ``top_k`` largest logits if given."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    src: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
) -> Tensor:
    """Continue ``prompt`` (B, P) by ``max_new_tokens`` tokens; returns (B, P + max_new_tokens).

    Args:
        model: a :class:`DecoderLM`, or an :class:`EncoderDecoder` together with ``src`` (B, M)
            (encoded once; for kernelized cross-attention the source's (S, z) is formed once and
            read by every step).
        prompt: at least one token per sequence (for an encoder-decoder, usually BOS).
        temperature: 0 for greedy decoding, > 0 to sample.
        top_k: sample among the k largest logits only (needs ``temperature > 0``).
        generator: random source for sampling, for reproducible samples.
        eos_id: once a sequence has produced it, it keeps producing it; generation stops early
            when every sequence has, and the rest is filled with ``eos_id``.

    The tokens equal greedy (or, with the same random draws, sampled) decoding by the full
    causal forward over the growing sequence, at one step's cost per token. Runs without
    recording gradients; put the model in eval mode for deterministic random features and no
    dropout.
    """
    if not isinstance(model, (DecoderLM, EncoderDecoder)):
        raise ValueError(f"model must be a DecoderLM or EncoderDecoder, not {type(model).__name__}")
    if isinstance(model, EncoderDecoder) != (src is not None):
        raise ValueError("src must be given exactly when model is an EncoderDecoder")
    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.shape[1] < 1:
        shape = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
        raise ValueError(f"prompt must be a (B, P) token tensor with P >= 1, got {shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
        max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (temperature == 0 or top_k < 1):
        raise ValueError(f"top_k must be >= 1 and needs temperature > 0, got top_k={top_k!r}")
    tokens = [prompt]
    if max_new_tokens == 0:
        return prompt
    with torch.no_grad():
        state = model.start(src) if src is not None else None
        logits, state = model.prefill(prompt, state)
        logits = logits[:, -1]
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)
                done |= nxt == eos_id
            tokens.append(nxt[:, None])
            if i + 1 == max_new_tokens:
                break
            if eos_id is not None and bool(done.all()):
                rest = max_new_tokens - i - 1
                tokens.append(nxt.new_full((prompt.shape[0], rest), eos_id))
                break
            logits, state = model.step(nxt, state)
    return torch.cat(tokens, 1)
