"""rvz-bench: the benchmark CLI (see rvz/bench/cli.py)."""
