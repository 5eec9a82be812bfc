"""A rank that dies or stalls makes every other rank raise within the timeout,
naming what was pending and who is missing. Never a silent hang."""

from __future__ import annotations

import re

import pytest

from hemiola.launch import run_local

import workers


@pytest.mark.parametrize("schedule,optimizer", [("wfbp", "sgd"), ("decoupled", "adamw")])
def test_killed_rank_makes_survivors_raise_naming_it(schedule: str, optimizer: str) -> None:
    # decoupled with AdamW takes a preview: two lanes (previews and full
    # reductions) wait on the dead rank, and the survivors still raise.
    timeout_s = 5.0
    outcome = run_local(workers.killed_rank, 3, 2, timeout_s, schedule, optimizer,
                        expect_errors=True, timeout_s=90)
    assert outcome[2][0] == "error"  # killed: no result
    for rank in (0, 1):
        status, text = outcome[rank]
        assert status == "ok", text
        assert text.startswith("raised after"), text
        seconds = float(re.search(r"raised after ([\d.]+)s", text).group(1))
        # Gloo's own timeout plus the short grace period used to name missing ranks.
        assert seconds < timeout_s + min(10.0, timeout_s) + 5.0, text
        if schedule == "wfbp":
            assert "gradient reduction" in text and "bucket" in text
            assert "net." in text  # names the pending parameters
        # Exactly the dead rank: a survivor still inside the failed operation is
        # alive (it used to be named too, when it failed after the grace period).
        missing = re.search(r"Ranks missing \(dead, or stalled before operation #\d+\): "
                            r"\[([\d, ]*)\]", text)
        assert missing is not None, f"no missing ranks named: {text}"
        assert missing.group(1) == "2", f"the dead rank alone should be named: {text}"


def test_stalled_rank_times_out_on_the_others() -> None:
    timeout_s = 3.0
    outcome = run_local(workers.stalled_rank, 2, timeout_s, expect_errors=True, timeout_s=60)
    status, text = outcome[0]
    assert status == "ok", text
    assert "HemiolaTimeoutError" in text or "TimeoutError" in text, text
    seconds = float(re.search(r"raised after ([\d.]+)s", text).group(1))
    assert timeout_s * 0.9 < seconds < timeout_s + 10.0, text
    assert "[1]" in text, text


@pytest.mark.parametrize("schedule", ["wfbp", "priority", "decoupled"])
def test_check_finite_names_the_parameter_on_every_rank(schedule: str) -> None:
    results = run_local(workers.non_finite_gradient, 2, schedule, timeout_s=120)
    for rank, message in results.items():
        assert "holds NaN or infinity in iteration" in message, (rank, message)
        assert re.search(r"parameter '[\w.]+'", message), message
        assert "finite parameters: True" in message, message
