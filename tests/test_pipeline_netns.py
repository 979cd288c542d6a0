"""The embedding pipeline with its PS shard and worker in network namespaces of their own, the
worker's link shaped to 1 Gbit/s (``tc tbf``): staleness 0 and 1 both complete over the
wire, reach close AUCs, and nothing (process, namespace) is left behind.

The throughput ratio is not asserted: on a shared 2-core machine it moves from run to run
by more than the margin (1.15x to 1.5x in alternating runs of the benchmark), so it is the
benchmark's figure (``python -m examples.embedding_pipeline.overlap``, examples/README.md).
The AUC bound here is looser than the benchmark's 0.005: this run has 30 steps, early in
training, where staleness 1 still trails a little. Skipped, with the reason printed, where
namespaces cannot be made.
"""

from __future__ import annotations

import subprocess

import pytest

from examples import netns
from examples.embedding_pipeline import overlap

pytestmark = pytest.mark.timeout(240)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.process
def test_staleness_0_and_1_complete_over_a_shaped_link_with_close_aucs() -> None:
    args = overlap.parse_args(["--rounds", "1", "--steps", "30", "--shards", "1", "--batch-size", "1024",
                            "--dim", "16", "--hidden", "64", "--eval-samples", "5000", "--timeout", "120"])
    try:
        before = namespaces()
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"no `ip netns`: {exc}")
        pytest.skip(f"no `ip netns`: {exc}")
    try:
        summary = overlap.compare(args, say=print)
    except netns.NamespacesUnavailable as exc:
        print(str(exc))
        pytest.skip(str(exc))
    assert namespaces() <= before  # every namespace (and its veth pairs) is gone
    runs = summary["runs"]
    assert [r["staleness"] for r in runs] == [0, 1]
    assert all(r["steps"] == 30 for r in runs), runs
    assert summary["link_gbit_s"] < 1.2  # the shaping is in place
    assert summary["auc"][0] > 0.6 and summary["auc_gap"] < 0.02, summary
    bound = summary["bound"]  # per step: MG's compute, EG's PS calls and their wire time
    assert bound["compute_ms"] > 0 and bound["ps_ms"] > 0 and bound["wire_ms"] > 0, bound
