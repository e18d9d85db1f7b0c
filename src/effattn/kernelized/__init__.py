"""The engine of the kernelized (random-feature and linear) methods: random projections, feature
maps, the linear-attention core (non-causal, causal chunkwise, gated, recurrent: core.py) and its
device strategies (cpu.py, gpu.py; the chunkwise factors they share: chunkwise.py), the base class
that binds them to the contract (base.py), their FLOP model (flops.py) and their sequence-parallel
strategy, an exchange of fixed-size key states (parallel.py)."""
