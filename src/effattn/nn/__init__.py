"""Neural-network building blocks with a pluggable attention method, and :func:`swap` to put one
into an existing torch model."""

from effattn.nn.attention import CrossState, MultiheadAttention, swap
from effattn.nn.blocks import BlockState, FeedForward, TransformerBlock
from effattn.nn.generate import generate, sample_next
from effattn.nn.models import DecoderLM, DecoderState, EncoderClassifier, EncoderDecoder
from effattn.nn.positional import SinusoidalPositionalEncoding, sinusoidal

__all__ = [
    "BlockState",
    "CrossState",
    "DecoderLM",
    "DecoderState",
    "EncoderClassifier",
    "EncoderDecoder",
    "FeedForward",
    "MultiheadAttention",
    "SinusoidalPositionalEncoding",
    "TransformerBlock",
    "generate",
    "sample_next",
    "sinusoidal",
    "swap",
]
