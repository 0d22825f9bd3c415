"""What elastic-run reads from a script's source before running it: which torch modules to preload in the zygote,
and whether the script calls `elastic.run` (only then can it start in standby)."""

from __future__ import annotations

import pytest

from launcher.workers.warm_interpreter import calls_elastic_run


@pytest.mark.parametrize(
    ("source", "calls"),
    [
        ("import elastic\nelastic.run(main, config)\n", True),
        ("import elastic\nif __name__ == '__main__':\n    elastic.run(main)\n", True),
        ("import elastic\ndef cli():\n    return elastic.run(main)\ncli()\n", True),
        ("from elastic import run\nrun(main)\n", True),
        ("from elastic import run as go\ngo(main)\n", True),
        ("import elastic as el\nel.run(main)\n", True),
        ("main()\n", False),
        ("import subprocess\nsubprocess.run(['ls'])\n", False),
        ("import elastic\nelastic.heartbeat(1)\nmain()\n", False),
        ("from elastic import heartbeat as run\nrun(1)\n", False),
        ("def broken(:\n", False),
    ],
)
def test_calls_elastic_run(tmp_path, source, calls):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert calls_elastic_run(str(script)) is calls


def test_a_missing_script_does_not_call_it(tmp_path):
    assert calls_elastic_run(str(tmp_path / "absent.py")) is False
