"""A torch DLRM whose embedding tables live on the parameter server (``examples.param_server``).

* ``service``: ``EmbeddingService``, the Embedding Graph of one torch worker (PS pulls ahead
  at staleness k, pushes, read-only reads) on an rvz loop in a background thread, over the
  embedding pipeline's ``PipelineDataset`` and ``ExchangeManager``.
* ``embedding``: ``PSEmbeddingBagCollection`` (``nn.EmbeddingBag``'s interface over PS
  tables, with ``PSEmbeddingBagFunction`` pushing the sparse gradients in the backward pass)
  and ``LocalEmbeddingBagCollection`` (the same over local ``nn.EmbeddingBag``).
* ``sparse_adam``: the PS optimizer with ``torch.optim.SparseAdam``'s arithmetic.
* ``data``: Criteo columns as 26 jagged features; ``model``: the DLRM; ``train``: a run over
  the PS and the reference run in one process; ``shards``: the PS shard processes.

Run ``python -m examples.torch_dlrm --help``. Needs torch (the ``torch`` extra).

This package imports nothing itself: ``python -m`` imports it before ``__main__``, which
must be able to say that torch is missing.
"""
