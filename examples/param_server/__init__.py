"""A sharded parameter server for sparse hash-table embeddings, on rvz.

The table (import these; the rest is the service):

    from examples.param_server import EmbeddingTable, SGD, Adagrad, Adam, Ftrl
"""

from .optimizers import SGD, Adagrad, Adam, Ftrl, SparseOptimizer
from .table import EmbeddingTable, MinCount, Probability

__all__ = ["SGD", "Adagrad", "Adam", "EmbeddingTable", "Ftrl", "MinCount", "Probability",
           "SparseOptimizer"]
