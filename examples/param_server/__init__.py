"""A sharded parameter server for sparse hash-table embeddings, on rvz.

Modules, bottom up:

* ``sparse``: id hashing, sharding, seeded row init, duplicate sums (pure numpy).
* ``optimizers``: Adagrad and Adam with their slots in the embedding row, and the small
  replicated hot state (global step, beta powers).
* ``store``: one shard's hash table of rows: create on lookup, evict, incremental export.
* ``protocol``: the rvz keys workers and shards exchange (one per edge and step).
* ``server``: a PS shard serving its store over an ``rvz.Node``.
* ``client``: the worker side: dedup, shard, look up, scatter back, push.
* ``launch`` / ``workload``: process plumbing and the demo's synthetic workload.

Run the demo with ``python -m examples.param_server --help``.
"""

from .client import PSClient
from .launch import Processes, PSConfig, local_cluster, make_store, run_shard, start_shards
from .optimizers import Adagrad, Adam, SparseOptimizer, make_optimizer
from .protocol import END, edge
from .server import ShardServer
from .store import EmbeddingStore, Export

__all__ = [
    "END", "Adagrad", "Adam", "EmbeddingStore", "Export", "PSClient", "PSConfig", "Processes",
    "ShardServer", "SparseOptimizer", "edge", "local_cluster", "make_optimizer", "make_store",
    "run_shard", "start_shards",
]
