"""The project's scripts and the README's code: ``scripts/test`` runs every leg and says how
each ended, and the README's quick start runs as one script and prints what it received."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# An example or a program, which the choice of hot paths does not change: scripts/test
# runs these in its compiled leg only.
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent

# Stands in for the virtualenv's python: rvz counts as installed and compiled, pdoc is
# missing (scripts/docs stops before it touches docs/api) and pytest fails.
FAKE_PYTHON = """#!/bin/sh
case "$1" in
  -c) case "$2" in *pdoc*) exit 1 ;; esac; exit 0 ;;
  -m) exit 3 ;;
esac
exit 0
"""


def _fake_venv(venv: Path, ruff_status: int) -> None:
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("ruff", f"#!/bin/sh\nexit {ruff_status}\n"),
                       ("mypy", "#!/bin/sh\nexit 0\n")):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    build_hash = subprocess.run(
        ["bash", "-c", "source scripts/_venv.sh && build_inputs_hash"], cwd=ROOT,
        capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (venv / ".rvz-install").write_text(f"{build_hash}\ndocs,test\n")


@pytest.mark.skipif(sys.platform == "win32", reason="a bash script")
def test_scripts_test_runs_every_leg_and_fails_at_the_end(tmp_path: Path) -> None:
    """A failing leg (ruff here) no longer hides the others: each runs, a summary line per
    leg says how it ended, and the exit status is non-zero when any failed."""
    if not list((ROOT / "examples" / "param_server").glob("_table.*.so")):
        pytest.skip("the example's compiled table is not built in this checkout")
    venv = tmp_path / "venv"
    _fake_venv(venv, ruff_status=1)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test")], cwd=ROOT,
                          env=dict(os.environ, VENV=str(venv)), capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode != 0, out
    for leg in ("ruff", "mypy", "tests: compiled hot paths", "tests: pure-Python hot paths",
                "API reference"):
        assert f"== {leg}\n" in out, (leg, out, proc.stderr)
    summary = out.split("== summary\n", 1)[1].splitlines()
    assert all(re.search(r"\d+ s\)$", line) for line in summary), summary  # each leg's time
    summary = [re.sub(r", \d+ s\)$", ")", re.sub(r" \(\d+ s\)$", "", line)) for line in summary]
    assert summary == ["FAILED  ruff (exit 1)", "passed  mypy",
                       "FAILED  tests: compiled hot paths (exit 3)",
                       "FAILED  tests: pure-Python hot paths (exit 3)",
                       "FAILED  API reference (exit 1)"], out


def readme_block(start: str) -> str:
    """The README's first python block after the text ``start`` (or that begins with it)."""
    text = (ROOT / "README.md").read_text()
    assert start in text, f"the README has no {start!r}"
    before, _, after = text.partition(start)
    opening = before.rfind("```python\n")
    if opening >= 0 and "```" not in before[opening + 10:]:  # ``start`` is inside that block
        after = before[opening:] + start + after
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match is not None, f"no python block at {start!r} in the README"
    return match.group(1)


def readme_quick_start() -> str:
    return readme_block("## Quick start")


def test_the_readme_quick_start_runs_as_one_script(tmp_path: Path) -> None:
    """Pasted as it is, the quick start runs both nodes and prints what the ps received."""
    script = tmp_path / "quick_start.py"
    script.write_text(readme_quick_start())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RVZ_SECRET", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["ps received 1024 values of emb_0, sum 523776.0",
                     "worker received step 42's answer: ok"], proc.stdout
