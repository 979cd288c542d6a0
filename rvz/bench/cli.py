"""Placeholder replaced by the benchmark CLI."""


def main() -> int:
    return 0
