"""The embedding pipeline: Embedding Graph (EG) and Main Graph (MG) on rvz, data-parallel.

* ``criteo``: the Criteo Display Advertising format (streaming loader, feature hashing and
  log transform, gzip, bad-line policy) and a column cache of the parsed file.
* ``synthetic``: planted data written in that format, with the oracle's AUC.
* ``exchange``: ``PipelineDataset`` (global batch ids, one iterator for EG and one for MG)
  and ``ExchangeManager`` (per-batch samples, unique-id index, hand-offs as rvz keys in the
  batch's step, freed once both sides are done).
* ``model``: MG's numpy MLP and dense Adam; ``allreduce``: ring all-reduce over rvz keys.
* ``trainer``: one worker's EG and MG with deterministic staleness k, against the parameter
  server of ``examples.param_server`` (bsp); ``metrics``: AUC by ranks, logloss.
* ``launch``: PS shard and worker processes of one run; ``reference``: the sequential loop.

Run ``python -m examples.embedding_pipeline --help``.

This package imports nothing itself: the demo must pin numpy's BLAS threads before numpy
is first imported (see ``__main__``), and ``python -m`` imports the package first.
"""
