"""Issue 35's faults, as real jobs: one 2-rank serving job (staged) lives through three rounds, each joined by a
fresh 2-rank trainer job (its own torchrun), all started at once:

    round 0  ok (negated weights); a trainer sending a wrong shape (refused, the link stays usable);
             trainer rank 1 SIGKILLed mid-transfer
    round 1  trainer rank 1 SIGSTOPped mid-transfer (alive, silent)
    round 2  ok (the checkpoint's weights: a refit after the failures succeeds); serving rank 1 SIGKILLed
             mid-transfer

Every live rank of both jobs prints one `distload: error on rank R: ...` line within the timeout (a torchrun
agent ends the rest of the job whose rank died); the staged serving params stay the last good version bitwise.
"""

from __future__ import annotations

import pytest
from hf_models import save_checkpoint
from refit_jobs import finish, free_ports, start

TIMEOUT_S = 10.0
ENDED_BY_S = TIMEOUT_S + 8.0   # the timeout, the failing rank's brief notice to its peers, the error's output


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    work = tmp_path_factory.mktemp("refit-faults")
    model = save_checkpoint("llama", work / "model", seed=0)
    sync = work / "sync"
    sync.mkdir()
    port = free_ports(3)
    common = ["--model", str(model), "--port", str(port), "--sync", str(sync), "--timeout", str(TIMEOUT_S)]
    serving = start("serving", 2, ["serving", *common, "--peers", "2", "--plan=-,shape,+|+|+,-",
                                   "--arm", "kill@rank1:refit-receive:2", "--arm-at", "2:2"], work)
    trainers = [
        start("trainer0", 2, ["trainer", *common, "--peers", "2", "--round", "0", "--steps=-,shape,+",
                              "--arm", "kill@rank1:refit-send:2", "--arm-at", "0:3"], work),
        start("trainer1", 2, ["trainer", *common, "--peers", "2", "--round", "1", "--steps=+",
                              "--arm", "stop@rank1:refit-send:2", "--arm-at", "1:1"], work),
        start("trainer2", 2, ["trainer", *common, "--peers", "2", "--round", "2", "--steps=+,-"], work),
    ]
    every = [serving, *trainers]
    finish(every, serving, limit_s=420, grace_s=30)
    for job in every:   # what each job printed, for `pytest -s` (the closing notes quote it)
        print("\n".join(f"{job.name}: distload: error on rank {r}: {m}" for r, ms in job.errors().items() for m in ms))
    return {job.name: job for job in every}


def _seconds(rest: str) -> float:
    return float(rest.split("after ", 1)[1].split("s", 1)[0])


def _logs(jobs) -> str:
    return "\n".join(f"===== {name} rc={job.rc}\n{job.output[-6000:]}" for name, job in jobs.items())


def test_a_refused_step_leaves_the_link_usable(jobs):
    serving, trainer = jobs["serving"].outcomes(), jobs["trainer0"].outcomes()
    for rank in (0, 1):
        what, rest = serving[(rank, 0, 1)]
        assert what == "ok" and "version=1 new_weights=True" in rest, _logs(jobs)
        assert serving[(rank, 0, 2)][0] == "refused" and "unchanged=True version=1" in serving[(rank, 0, 2)][1]
        assert trainer[(rank, 0, 1)][0] == "ok" and trainer[(rank, 0, 2)][0] == "refused", _logs(jobs)
    refusals = jobs["serving"].errors()
    assert all("model.layers.0.self_attn.q_proj.weight" in refusals[r][0] for r in (0, 1)), refusals


def test_a_killed_trainer_rank_fails_every_serving_rank_with_the_old_weights_kept(jobs):
    serving = jobs["serving"].outcomes()
    for rank in (0, 1):
        what, rest = serving[(rank, 0, 3)]
        assert what == "failed" and "unchanged=True version=1" in rest, _logs(jobs)
        assert _seconds(rest) <= ENDED_BY_S, rest
        assert "trainer rank 1" in jobs["serving"].errors()[rank][1], jobs["serving"].errors()
    assert jobs["trainer0"].rc not in (0, None), _logs(jobs)   # its agent ended the job, naming the dead rank
    assert "exitcode  : -9" in jobs["trainer0"].output, _logs(jobs)


def test_a_stalled_trainer_rank_ends_the_step_on_every_live_rank_within_the_timeout(jobs):
    serving, trainer = jobs["serving"].outcomes(), jobs["trainer1"].outcomes()
    for rank in (0, 1):
        what, rest = serving[(rank, 1, 1)]
        assert what == "failed" and "unchanged=True version=1" in rest, _logs(jobs)
        assert TIMEOUT_S - 1 <= _seconds(rest) <= ENDED_BY_S, rest
        assert "trainer rank 1" in jobs["serving"].errors()[rank][2], jobs["serving"].errors()
    what, rest = trainer[(0, 1, 1)]     # the stalled rank's live peer in its own job
    assert what == "failed" and _seconds(rest) <= ENDED_BY_S, _logs(jobs)
    assert len(jobs["trainer1"].errors()[0]) == 1 and (1, 1, 1) not in trainer, _logs(jobs)


def test_the_next_refit_succeeds_and_a_killed_serving_rank_fails_the_trainers(jobs):
    serving, trainer = jobs["serving"].outcomes(), jobs["trainer2"].outcomes()
    for rank in (0, 1):
        what, rest = serving[(rank, 2, 1)]
        assert what == "ok" and "version=2 new_weights=True" in rest, _logs(jobs)
        assert trainer[(rank, 2, 1)][0] == "ok", _logs(jobs)
        what, rest = trainer[(rank, 2, 2)]
        assert what == "failed" and _seconds(rest) <= ENDED_BY_S, _logs(jobs)
        assert len(jobs["trainer2"].errors()[rank]) == 1, jobs["trainer2"].errors()
    # the first to notice names the dead rank (the others may find its job's store gone with it: then the cause)
    assert any("serving rank 1" in lines[0] for lines in jobs["trainer2"].errors().values()), _logs(jobs)
    assert jobs["trainer2"].rc == 1 and "exitcode  : -9" in jobs["serving"].output, _logs(jobs)
