"""The speed and memory sweep of ``effattn bench``, and the pieces the other tools time with.

- :mod:`~effattn.tools.bench.timing`   warm-up + repeated timing, median and IQR, disturbance
- :mod:`~effattn.tools.bench.machine`  CPU model, vector extensions and versions of every summary
- :mod:`~effattn.tools.bench.memory`   peak memory of one call (RSS high-water mark / CUDA)
- :mod:`~effattn.tools.bench.flops`    FLOP models per method, measured matmul peak, reference GEMM
- :mod:`~effattn.tools.bench.speed`    one configuration measured in an isolated process, the sweep
- :mod:`~effattn.tools.bench.results`  the resumable result store, crossover lengths, tables
- :mod:`~effattn.tools.bench.plots`    PNG figures (matplotlib, Agg)
"""
