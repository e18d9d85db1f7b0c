"""The measuring tools behind the ``effattn`` command, apart from the library (``import effattn``
never imports them). They need the extra ``tools`` (``pip install 'effattn[tools]'``): numpy,
matplotlib and tqdm, listed in :data:`REQUIRES`.

- :mod:`effattn.tools.bench`    the speed and memory sweep (``effattn bench``): timing, machine,
                                memory, FLOP models, the isolated worker, results, plots
- :mod:`effattn.tools.bench_distributed`  sequence-parallel memory, time and bytes per rank
                                (``effattn bench-distributed``)
- :mod:`effattn.tools.approx`   output error vs exact attention (``effattn approx``)
- :mod:`effattn.tools.decode`   token-by-token decoding speed and state memory (``effattn decode``)
- :mod:`effattn.tools.tasks`    the generated data sets: ListOps, recall, copy, reverse, char LM
- :mod:`effattn.tools.train`    the training loop (``effattn train``)
- :mod:`effattn.tools.runs`     a trained model rebuilt from its run folder (``load_run``)
- :mod:`effattn.tools.compare`  every method trained on one budget, one table (``effattn compare``)
- :mod:`effattn.tools.convert`  a softmax teacher converted to other methods, every stage
                                measured (``effattn convert``)
"""

from __future__ import annotations

import importlib.util

# The distributions the extra `tools` installs, by the name they are imported under.
REQUIRES = ("matplotlib", "numpy", "tqdm")


def missing() -> list[str]:
    """The modules of :data:`REQUIRES` that cannot be imported here (found without importing)."""
    return [name for name in REQUIRES if importlib.util.find_spec(name) is None]
