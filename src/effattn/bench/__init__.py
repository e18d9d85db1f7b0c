"""Measurement tools: speed/memory sweeps (``effattn bench``), the approximation study
(``effattn approx``) and the decoding benchmark (``effattn decode``).

- :mod:`effattn.bench.timing`   warm-up + repeated timing, median and IQR, disturbance verdict
- :mod:`effattn.bench.machine`  CPU model, vector extensions and versions of every summary
- :mod:`effattn.bench.memory`   peak memory of one call (RSS high-water mark / CUDA allocator)
- :mod:`effattn.bench.flops`    FLOP models per method, the measured matmul peak, reference GEMM
- :mod:`effattn.bench.speed`    one configuration measured in an isolated process, and the sweep
- :mod:`effattn.bench.results`  the resumable result store, crossover lengths, terminal tables
- :mod:`effattn.bench.plots`    PNG figures (matplotlib, Agg)
- :mod:`effattn.bench.approx`   output error vs exact attention, and the kernel-estimator MSE study
- :mod:`effattn.bench.decode`   tokens/s, per-token time and state memory of token-by-token decoding
"""
