"""rvz's public API is typed: ``mypy --strict`` passes on a user program that uses all of it
(tests/typing_programs/uses_everything.py) and catches the mistakes marked ``# E: code`` in
tests/typing_programs/typos.py: a misspelt mode, transport or loop, a misspelt ``Key``
attribute (so ``rvz.Key`` is a class, not ``Any``), and a received value used as an ``int``
(so ``recv`` returns ``rvz.Value``, not ``Any``).

rvz's own modules are checked as an installed package would be: errors inside them are not
reported here (``mypy rvz`` checks them with the project's settings).
"""

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
PROGRAMS = Path(__file__).resolve().parent / "typing_programs"
CONFIG = """\
[mypy]
strict = True
python_version = {major}.{minor}

[mypy-rvz.*]
ignore_errors = True
"""


def run_mypy(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy", reason="mypy is in the test extra")
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG.format(major=sys.version_info[0], minor=sys.version_info[1]))
    env = dict(os.environ, MYPYPATH=str(ROOT))  # this checkout's rvz, however it is installed
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-error-summary",
           "--show-error-codes", "--cache-dir", str(ROOT / ".mypy_cache" / "test_typing"),
           *map(str, files)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (a crash, bad options)
        pytest.fail(f"mypy failed to run:\n{proc.stdout}\n{proc.stderr}")
    return proc


def errors_by_line(output: str, path: Path) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    pattern = re.compile(rf"^{re.escape(path.name)}:(\d+): error: (.*)\[([a-z-]+)\]$")
    for line in output.splitlines():
        m = pattern.match(line.replace(str(path), path.name))
        if m:
            found.setdefault(int(m.group(1)), []).append(m.group(3))
    return found


@pytest.mark.timeout(300)
def test_mypy_strict(tmp_path: Path) -> None:
    good = PROGRAMS / "uses_everything.py"
    bad = PROGRAMS / "typos.py"
    proc = run_mypy(tmp_path, good, bad)
    out = proc.stdout
    good_lines = [line for line in out.splitlines() if good.name in line]
    assert not good_lines, "mypy --strict rejects a correct program:\n" + "\n".join(good_lines)

    expected = {}
    for n, line in enumerate(bad.read_text().splitlines(), 1):
        m = re.search(r"# E: ([a-z-]+)$", line)
        if m:
            expected[n] = m.group(1)
    assert expected, "typos.py marks no expected errors"
    got = errors_by_line(out, bad)
    missed = {n: code for n, code in expected.items() if code not in got.get(n, [])}
    lines = bad.read_text().splitlines()
    assert not missed, "mypy --strict let these mistakes through:\n" + "\n".join(
        f"  typos.py:{n}: {lines[n - 1].strip()}" for n in missed) + f"\nmypy said:\n{out}"
    unexpected = {n: codes for n, codes in got.items() if n not in expected}
    assert not unexpected, f"errors on lines not marked in typos.py: {unexpected}\n{out}"
