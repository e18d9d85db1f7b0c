"""Models built from pre-norm blocks: an encoder classifier, a decoder-only LM, an encoder-decoder.

All take ``method`` and its ``**options``; token embeddings plus sinusoidal positions
(:mod:`effattn.nn.positional`); a final LayerNorm before the output layer.

Padding: a method whose spec cannot take a key padding mask (e.g. FNet, whose Fourier mix has no
notion of a key) sees padding tokens as ordinary tokens of the input, as in the LRA setup; the
pooling of the classifier still ignores them. ``masks_padding`` records which case applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from effattn.nn.blocks import BlockState, TransformerBlock, check_capability, layer_seed
from effattn.nn.positional import SinusoidalPositionalEncoding
from effattn.registry import DEFAULT_METHOD, spec


def _check_tokens(tokens: Tensor, vocab_size: int, arg: str = "tokens") -> None:
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"{arg} must be a (B, N) int64 tensor, got {shape} "
                         f"{getattr(tokens, 'dtype', '')}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{arg} must lie in [0, {vocab_size}), got values in "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")


def _step_tokens(tokens: Tensor, vocab_size: int) -> Tensor:
    """One token per sequence, (B,) or (B, 1) -> (B, 1), checked."""
    if isinstance(tokens, Tensor) and tokens.dim() == 1:
        tokens = tokens[:, None]
    _check_tokens(tokens, vocab_size)
    if tokens.shape[1] != 1:
        raise ValueError(f"step takes one token per sequence, got tokens {tuple(tokens.shape)}")
    return tokens


class _Embed(nn.Module):
    """Token embedding scaled by sqrt(d) plus sinusoidal positions, then dropout."""

    def __init__(self, vocab_size: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tokens = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.tokens.weight, std=d_model ** -0.5)
        self.scale = math.sqrt(d_model)
        self.pos = SinusoidalPositionalEncoding(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        return self.drop(self.pos(self.tokens(tokens) * self.scale, offset))


def _no_causal_inputs(method: str, options: dict[str, Any], what: str) -> None:
    """Refuse options that give ``method`` a call input defined for causal attention only."""
    for c in spec(method).required_inputs(options):
        if c.causal_only:
            raise ValueError(
                f"{c.enabled_by}=True gives {method} the call input {c.name}, defined for causal "
                f"self-attention only; {what} is not causal (use DecoderLM or EncoderDecoder)"
            )


class EncoderClassifier(nn.Module):
    """Bidirectional encoder over tokens (B, N) -> class logits (B, C).

    Args:
        pool: ``"mean"`` over non-padding positions, or ``"cls"``: a learned token prepended at
            position 0 whose final state is classified.
        pad_id: the padding token id (positions equal to it are padding).
        max_len: longest input (add 1 for ``pool="cls"`` is done here).
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        method: str = DEFAULT_METHOD,
        *,
        ff_mult: int = 4,
        dropout: float = 0.0,
        pool: str = "mean",
        pad_id: int = 0,
        max_len: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {pool!r}")
        _no_causal_inputs(method, options, "EncoderClassifier")
        self.pool = pool
        self.pad_id = pad_id
        self.masks_padding = spec(method).padding_mask
        if pool == "cls":
            self.cls = nn.Parameter(torch.randn(d_model) * d_model ** -0.5)
            max_len = None if max_len is None else max_len + 1
        self.embed = _Embed(vocab_size, d_model, dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, num_heads, method, ff_mult=ff_mult, dropout=dropout,
                             max_len=max_len, seed=layer_seed(seed, i), **options)
            for i in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        _check_tokens(tokens, self.embed.vocab_size)
        pad = tokens == self.pad_id
        x = self.embed.tokens(tokens) * self.embed.scale
        if self.pool == "cls":
            x = torch.cat((self.cls.expand(x.shape[0], 1, -1).to(x.dtype), x), dim=1)
            pad = torch.cat((pad.new_zeros(pad.shape[0], 1), pad), dim=1)
        x = self.embed.drop(self.embed.pos(x))
        kpm = pad if self.masks_padding and bool(pad.any()) else None
        for block in self.blocks:
            x = block(x, key_padding_mask=kpm)
        x = self.norm(x)
        if self.pool == "cls":
            pooled = x[:, 0]
        else:
            keep = (~pad).to(x.dtype)[..., None]
            pooled = (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.head(pooled)


@dataclass
class DecoderState:
    """Incremental decoding state of a model: next position and one state per block."""

    position: int = 0
    layers: list[BlockState] = field(default_factory=list)


class DecoderLM(nn.Module):
    """Decoder-only causal LM: tokens (B, N) -> next-token logits (B, N, V).

    :meth:`step` decodes one token at a time with each layer's method state (KV cache for
    softmax, fixed-size (S, z) for kernelized methods); it equals the parallel forward.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        method: str = DEFAULT_METHOD,
        *,
        ff_mult: int = 4,
        dropout: float = 0.0,
        max_len: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        check_capability(method, "causal", "DecoderLM")
        self.embed = _Embed(vocab_size, d_model, dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, num_heads, method, causal=True, ff_mult=ff_mult,
                             dropout=dropout, max_len=max_len, seed=layer_seed(seed, i),
                             **options)
            for i in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """tokens (B, N) at positions offset .. offset + N - 1 (a slice of longer sequences,
        when the attention layers run sequence parallel) -> logits (B, N, V)."""
        _check_tokens(tokens, self.embed.vocab_size)
        x = self.embed(tokens, offset)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def step(
        self, tokens: Tensor, state: DecoderState | None = None
    ) -> tuple[Tensor, DecoderState]:
        """Feed one token per sequence, tokens (B,); returns (logits (B, V), state)."""
        if state is None:
            state = DecoderState(layers=[block.start() for block in self.blocks])
        x, state = _decode(self.embed, self.blocks, _step_tokens(tokens, self.embed.vocab_size),
                           state, "step")
        return self.head(self.norm(x))[:, 0], state

    def prefill(
        self, tokens: Tensor, state: DecoderState | None = None
    ) -> tuple[Tensor, DecoderState]:
        """Feed a block of tokens (B, L) in parallel (a prompt); returns (logits (B, L, V),
        state). Equals L calls to :meth:`step`."""
        if state is None:
            state = DecoderState(layers=[block.start() for block in self.blocks])
        _check_tokens(tokens, self.embed.vocab_size)
        x, state = _decode(self.embed, self.blocks, tokens, state, "prefill")
        return self.head(self.norm(x)), state


def _decode(embed: _Embed, blocks: nn.ModuleList, tokens: Tensor, state: DecoderState,
            how: str) -> tuple[Tensor, DecoderState]:
    """Run tokens (B, L) through causal blocks from ``state``: the last hidden states (B, L, d)."""
    x = embed(tokens, offset=state.position)
    for i, block in enumerate(blocks):
        x, state.layers[i] = getattr(block, how)(x, state.layers[i])
    state.position += tokens.shape[1]
    return x, state


class EncoderDecoder(nn.Module):
    """Encoder (bidirectional) + decoder (causal self-attention and cross-attention).

    The encoder and the cross-attention use ``method`` without the options that turn on causal-only
    call inputs (``MethodSpec.non_causal_options``: gated RFA's gate belongs to causal
    self-attention); ``cross_method`` picks another mechanism for cross-attention, e.g. when
    ``method`` cannot attend across sequences of different lengths.
    """

    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        method: str = DEFAULT_METHOD,
        *,
        dec_layers: int | None = None,
        cross_method: str | None = None,
        ff_mult: int = 4,
        dropout: float = 0.0,
        pad_id: int = 0,
        max_len: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        cross_method = method if cross_method is None else cross_method
        check_capability(method, "causal", "the EncoderDecoder's decoder")
        check_capability(cross_method, "cross", "the EncoderDecoder's cross-attention "
                         "(pass cross_method='softmax' to use exact cross-attention)")
        self.pad_id = pad_id
        self.masks_padding = spec(method).padding_mask
        self.cross_masks_padding = spec(cross_method).padding_mask
        dec_layers = num_layers if dec_layers is None else dec_layers
        common = {"ff_mult": ff_mult, "dropout": dropout, "max_len": max_len}
        self.src_embed = _Embed(src_vocab, d_model, dropout)
        self.tgt_embed = _Embed(tgt_vocab, d_model, dropout)
        self.encoder = nn.ModuleList(
            TransformerBlock(d_model, num_heads, method, seed=layer_seed(seed, i), **common,
                             **spec(method).non_causal_options(options))
            for i in range(num_layers)
        )
        self.decoder = nn.ModuleList(
            TransformerBlock(d_model, num_heads, method, causal=True, cross=True,
                             cross_method=cross_method, seed=layer_seed(seed, num_layers + i),
                             **common, **options)
            for i in range(dec_layers)
        )
        self.enc_norm = nn.LayerNorm(d_model)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, tgt_vocab)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor | None]:
        """src (B, M) -> (memory (B, M, d), padding mask (B, M) or None)."""
        _check_tokens(src, self.src_embed.vocab_size, "src")
        pad = src == self.pad_id
        pad = pad if bool(pad.any()) else None
        x = self.src_embed(src)
        for block in self.encoder:
            x = block(x, key_padding_mask=pad if self.masks_padding else None)
        return self.enc_norm(x), pad

    def _memory_mask(self, pad: Tensor | None) -> Tensor | None:
        return pad if self.cross_masks_padding else None

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """src (B, M), tgt (B, N) (decoder input) -> logits (B, N, V)."""
        memory, pad = self.encode(src)
        _check_tokens(tgt, self.tgt_embed.vocab_size, "tgt")
        x = self.tgt_embed(tgt)
        for block in self.decoder:
            x = block(x, memory=memory, memory_key_padding_mask=self._memory_mask(pad))
        return self.head(self.norm(x))

    def start(self, src: Tensor) -> DecoderState:
        """Encode ``src`` once and return the decoding state (memory projected per layer)."""
        memory, pad = self.encode(src)
        return DecoderState(layers=[block.start(memory, self._memory_mask(pad))
                                    for block in self.decoder])

    def step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Feed one target token per sequence (B,); returns (logits (B, V), state)."""
        x, state = _decode(self.tgt_embed, self.decoder,
                           _step_tokens(tokens, self.tgt_embed.vocab_size), state, "step")
        return self.head(self.norm(x))[:, 0], state

    def prefill(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Feed a block of target tokens (B, L) in parallel; returns (logits (B, L, V), state)."""
        _check_tokens(tokens, self.tgt_embed.vocab_size, "tokens")
        x, state = _decode(self.tgt_embed, self.decoder, tokens, state, "prefill")
        return self.head(self.norm(x)), state
