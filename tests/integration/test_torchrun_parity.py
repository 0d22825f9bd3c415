"""Every flag of torchrun (torch.distributed.run's own parser) is accepted with torchrun's meaning and default,
or refused in one line that names it and says why."""

from __future__ import annotations

import argparse

import pytest
from launcher_harness import PROBE
from torch.distributed.run import get_args_parser

from launcher.commands.cli import UNSUPPORTED_FLAGS, ConfigError, build_parser, config_from_args

pytestmark = pytest.mark.timeout(30)

# flags whose default differs on purpose: ours, exactly, and why the meaning is still torchrun's
DIFFERENT_DEFAULTS = {
    "rdzv_backend": ("etcd", "elastic-run rendezvous only in etcd; torchrun's static/c10d are refused in one line"),
    "rdzv_id": (
        None,
        "unset means 'none' as in torchrun (a random id with --standalone, as torchrun's standalone does)",
    ),
    "shutdown_timeout": (30.0, "torchrun's None means TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30 s, which is our default"),
}
# a job on an external etcd: its config holds no random id (--standalone's), so two parses compare equal
ON_ETCD = ["--rdzv-endpoint", "127.0.0.1:2379", str(PROBE)]


def torchrun_actions() -> list[argparse.Action]:
    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


@pytest.fixture(autouse=True)
def no_pet_environment(monkeypatch):
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def test_every_torchrun_flag_is_known_to_elastic_run_by_every_spelling():
    ours = {option for action in build_parser()._actions for option in action.option_strings}
    missing = [o for a in torchrun_actions() for o in a.option_strings if o not in ours]
    assert not missing, f"torchrun flags elastic-run does not know: {missing}"


def elastic_run_action(action: argparse.Action) -> argparse.Action:
    """elastic-run's action for torchrun's `action`."""
    return next(a for a in build_parser()._actions if action.option_strings[0] in a.option_strings)


@pytest.mark.parametrize("action", torchrun_actions(), ids=lambda a: a.option_strings[-1])
def test_a_torchrun_flag_keeps_its_default_or_is_refused_in_one_line(action):
    mine = elastic_run_action(action)
    if mine.dest in DIFFERENT_DEFAULTS:
        return  # test_a_flag_with_a_default_of_its_own_has_exactly_the_one_the_table_gives
    if not mine.dest.startswith("unsupported_"):
        assert str(mine.default) == str(action.default), (mine.default, action.default)
        return
    flag = mine.dest.removeprefix("unsupported_")
    value = [] if action.nargs == 0 or isinstance(action.const, bool) else ["1"]
    args = build_parser().parse_args([action.option_strings[0], *value, "--standalone", str(PROBE)])
    with pytest.raises(ConfigError) as refused:
        config_from_args(args)
    message = str(refused.value)
    assert f"--{flag}" in message and UNSUPPORTED_FLAGS[flag] in message and "\n" not in message


@pytest.mark.parametrize("dest", sorted(DIFFERENT_DEFAULTS))
def test_a_flag_with_a_default_of_its_own_has_exactly_the_one_the_table_gives(dest):
    expected, why = DIFFERENT_DEFAULTS[dest]
    theirs = next(a for a in torchrun_actions() if a.dest == dest)
    mine = elastic_run_action(theirs)
    assert mine.dest == dest and set(theirs.option_strings) <= set(mine.option_strings)
    assert (mine.default, type(mine.default)) == (expected, type(expected)), f"the table says {expected!r}: {why}"
    assert str(mine.default) != str(theirs.default), "torchrun's default after all: drop the row"
    default = config_from_args(build_parser().parse_args(ON_ETCD))  # the default parses
    if expected is not None:  # and means what passing it does
        given = [theirs.option_strings[0], str(expected)]
        assert config_from_args(build_parser().parse_args([*given, *ON_ETCD])) == default


def test_the_defaults_that_differ_mean_what_torchrun_means():
    assert config_from_args(build_parser().parse_args(ON_ETCD)).rdzv_id == "none"
    assert len(parse().rdzv_id) == 12, "--standalone: a random id"
    with pytest.raises(ConfigError, match="--rdzv-backend static: elastic-run rendezvous only in etcd"):
        parse("--rdzv-backend", "static")


def parse(*flags: str):
    return config_from_args(build_parser().parse_args([*flags, "--standalone", str(PROBE)]))


def test_shutdown_timeout_is_the_grace_before_sigkill_and_the_old_flag_stays_an_alias(monkeypatch):
    assert parse().worker_stop_timeout == 30
    assert parse("--shutdown-timeout", "7").worker_stop_timeout == 7
    assert parse("--shutdown_timeout", "8").worker_stop_timeout == 8
    assert parse("--worker-stop-timeout", "3").worker_stop_timeout == 3
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert parse().worker_stop_timeout == 12


def test_duplicate_filters_take_torchruns_list_syntax_and_the_event_log_handler_only_null():
    config = parse("--duplicate-stdout-filters", "loss,,lr,step", "--duplicate_stderr_filters", "Error")
    assert config.duplicate_stdout_filters == ["loss,lr", "step"] and config.duplicate_stderr_filters == ["Error"]
    assert parse().duplicate_stdout_filters == []
    parse("--event-log-handler", "null")
    with pytest.raises(ConfigError, match="--event-log-handler console: elastic-run records every event"):
        parse("--event-log-handler", "console")


@pytest.mark.timeout(90)
def test_lines_matching_the_duplicate_filters_are_copied_into_the_attempts_filtered_log(cluster, tmp_path):
    script = tmp_path / "talk.py"
    script.write_text(
        "import os\nrank = os.environ['RANK']\nprint(f'loss 1.5 on {rank}')\nprint(f'noise on {rank}')\n"
        "print(f'step, loss 1.2 on {rank}')\n"
    )
    agent = cluster.start("n", [], script=script, extra=["--duplicate-stdout-filters", "loss,,lr,loss 1."])
    assert agent.wait(timeout=60) == 0, cluster.dump()
    filtered = (agent.log_dir / "n" / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    assert sorted(filtered) == sorted(f"{text} on {rank}" for text in ("loss 1.5", "step, loss 1.2") for rank in "01")
    assert "noise on 0" in agent.text() and "noise on 1" in agent.text(), "the console still gets every line"


@pytest.mark.parametrize(
    ("flags", "interval", "ttl"),
    [
        ([], 1.0, 3),
        (["--nnodes", "2:1024"], 1.0, 3),
        (["--nnodes", "1:1025"], 5.0, 15),  # past a thousand nodes: torchrun's keep-alive
        (["--nnodes", "4096"], 5.0, 15),
        (["--nnodes", "4096", "--rdzv-conf", "keep_alive_interval=2"], 2.0, 6),  # one chosen is kept
        (["--nnodes", "4096", "--rdzv-conf", "keep_alive_max_attempt=4"], 5.0, 20),
    ],
)
def test_the_lease_refresh_interval_grows_with_the_job_unless_rdzv_conf_chooses_it(flags, interval, ttl):
    rdzv = parse(*flags).rdzv
    assert (rdzv.keep_alive_interval, rdzv.lease_ttl) == (interval, ttl)
