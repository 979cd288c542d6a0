"""The embedding pipeline: Embedding Graph (EG) and Main Graph (MG) on rvz.

* ``data``: a seeded synthetic multi-field click task (batches of sparse ids and labels).
* ``exchange``: ``PipelineDataset`` (global batch ids, one iterator for EG and one for MG)
  and ``ExchangeManager`` (per-batch samples, unique-id index, embedding and gradient
  hand-offs over ``rvz.Rendezvous``, freed once both sides are done).
* ``model``: MG's dense numpy model (pooled embeddings -> MLP -> logistic loss).
* ``trainer``: EG's lookups (with a prefetch depth) and sparse updates against the
  parameter server of ``examples.param_server``, and MG's dense steps, run concurrently.

Run the demo with ``python -m examples.embedding_pipeline --help``.

This package imports nothing itself: the demo must pin numpy's BLAS threads before numpy
is first imported (see ``__main__``), and ``python -m`` imports the package first.
"""
