"""PS shard processes for the torch runs: the parameter server's own, knowing ``sparse_adam``.

Kept apart from the training code so that a shard process imports torch only for the
optimizer that needs it, and before it serves (not inside its first push).
"""

from __future__ import annotations

from typing import Any

from ..param_server.launch import PSConfig
from ..param_server.launch import shard_process as ps_shard_process
from .sparse_adam import NAME, register


def shard_process(cluster: dict[str, Any], shard: int, ps: PSConfig, restore: bool, results: Any) -> None:
    """Entry point of a shard process (``Processes.start`` adds ``results``)."""
    register()
    if any(spec.optimizer == NAME for spec in ps.table_specs()):
        import torch  # noqa: F401 - loaded now, not in the first push

    ps_shard_process(cluster, shard, ps, restore, results)
