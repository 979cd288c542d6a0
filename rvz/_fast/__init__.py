"""Hot paths: rendezvous keys, the per-key table and the frame codec.

Each module here is plain, typed Python that runs as is, and is also compiled by Cython
(with the ``.pxd`` beside it adding C types) when the package is built.  One source, two
implementations: ``rvz._impl`` picks which one is loaded.
"""
