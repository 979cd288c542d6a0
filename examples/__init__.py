"""Example applications built on rvz's public API only.

* ``examples.param_server``: a sharded parameter server for sparse hash-table embeddings
  (``python -m examples.param_server``).
* ``examples.embedding_pipeline``: the Embedding Graph / Main Graph training pipeline with a
  Pipeline Dataset and an ExchangeManager on top of that parameter server
  (``python -m examples.embedding_pipeline``).
"""
