"""rvz-bench: the benchmark CLI (``rvz.bench.cli``) and its worker processes
(``rvz.bench.worker``), with the parent/worker plumbing in ``rvz.bench.control`` and the
tables, targets and plot in ``rvz.bench.report``."""
