"""Example applications built on rvz's public API only.

* ``examples.param_server``: a sharded parameter server for sparse hash-table embeddings
  (``python -m examples.param_server``).
* ``examples.embedding_pipeline``: the Embedding Graph / Main Graph training pipeline with a
  Pipeline Dataset and an ExchangeManager on top of that parameter server
  (``python -m examples.embedding_pipeline``).

Importing the package sets the thread settings every entry point runs with (see
``THREAD_SETTINGS``), before numpy is loaded; child processes inherit them.
"""

import os

# One BLAS/OpenMP thread per process. On a small machine the libraries' own threads spin
# while they wait and steal the cores that the PS shards, EG and MG need. Set only where the
# user did not choose otherwise.
THREAD_SETTINGS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def apply_thread_settings() -> None:
    for name, value in THREAD_SETTINGS.items():
        os.environ.setdefault(name, value)


apply_thread_settings()
