"""Shared machinery of the kernelized (random-feature and linear) methods: random projections,
feature maps and the linear-attention core (non-causal, causal chunkwise, gated, recurrent)."""
