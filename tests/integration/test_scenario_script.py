"""examples/scenario.py stops as soon as the job it started has failed, and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scenario_returns_soon_after_the_job_fails_at_import(tmp_path):
    # An `elastic` that cannot be imported, found before the installed one: a checkout that was never installed
    fake = tmp_path / "not-installed" / "elastic"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'elastic\'", name="elastic")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake.parent), env.get("PYTHONPATH")]))
    work = tmp_path / "work"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "scenario.py"), "grow", "--workdir", str(work)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    ended, took = time.time(), time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    failed = [
        json.loads(line)
        for path in (work / "logs").glob("*/membership.jsonl")
        for line in path.read_text().splitlines()
        if '"job_failed"' in line
    ]
    assert failed, output[-4000:]
    # it used to wait 600 s for a world of 8 that would never train
    assert ended - min(e["time"] for e in failed) < 20, output[-4000:]
    assert took < 120, output[-4000:]
    assert "pip install -e ." in output  # the workers' one-line hint
    assert "elastic-run: job scenario failed" in output  # the agents' failure summary
    assert "job_failed" in output  # the membership log
