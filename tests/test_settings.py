"""The server's flags and environment variables, made from the settings' dataclasses: an enum
setting takes its names and nothing else, and survives the trip to a child's argv."""
import argparse

import pytest

from trillm.config import EngineArgs
from trillm.http import settings
from trillm.sched_ext import SchedulingPolicy


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p


def test_the_scheduling_policy_is_an_enum_by_flag_by_variable_and_in_argv():
    parsed = settings.from_args(parser().parse_args(["--scheduling-policy", "priority", "--max-num-seqs", "3"]))
    assert parsed.engine.scheduling_policy is SchedulingPolicy.PRIORITY
    again = settings.from_args(parser().parse_args(settings.to_argv(parsed)))
    assert again == parsed
    from_env = settings.from_env({"TRILLM_SCHEDULING_POLICY": "priority"})
    assert from_env.engine.scheduling_policy is SchedulingPolicy.PRIORITY
    assert EngineArgs(scheduling_policy="fcfs").scheduling_policy is SchedulingPolicy.FCFS


def test_an_unknown_policy_is_refused_everywhere(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--scheduling-policy", "lifo"])
    err = capsys.readouterr().err
    assert "--scheduling-policy" in err and "'lifo'" in err
    with pytest.raises(ValueError):
        EngineArgs(scheduling_policy="lifo")
    with pytest.raises(ValueError):
        settings.from_env({"TRILLM_SCHEDULING_POLICY": "lifo"})
