"""The failure path is bounded (issue 18): broken ranks learn who failed and why from the job's store with O(1)
store operations each per poll; one collector looks up the silent ranks, once. A real torch store (HashStore),
ranks as threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from distload.transfer import postmortem


class CountingStore:
    """A real store, counting the per-rank lookups (`check` of a rank's key) made through it."""

    def __init__(self, store):
        self.store, self.rank_lookups = store, 0

    def check(self, keys):
        self.rank_lookups += sum("/rank-" in k for k in keys)
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture(autouse=True)
def short_wait(monkeypatch):
    monkeypatch.setattr(postmortem, "WAIT_S", 0.5)


def _broken(store, step: int, world: int, ranks) -> list:
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda r: postmortem.gather(store, step, r, world, "lost a peer"), ranks))


def test_every_broken_rank_names_the_failed_one_and_the_silent_one():
    store, world = CountingStore(dist.HashStore()), 8
    postmortem.tell(store, 1, 2, "RuntimeError: injected fault")
    broken = [0, 1, 3, 4, 6, 7]                                   # rank 5 vanished
    for r, (causes, silent, count) in zip(broken, _broken(store, 1, world, broken)):
        assert causes == {2: "RuntimeError: injected fault"} and silent == [5] and count == 1, r
        message, failures = postmortem.describe("transfer", r, RuntimeError("lost a peer"), causes, silent, count, None)
        assert "rank 2 failed: RuntimeError: injected fault" in message and "no word from rank 5 within" in message
        assert failures == {5: "no word (vanished)", 2: "RuntimeError: injected fault", r: "lost a peer"}
    assert store.rank_lookups == world - 1       # one collector, once per rank; not every broken rank per peer


def test_many_failures_are_named_up_to_a_bound_with_their_count():
    store, world = CountingStore(dist.HashStore()), 64
    for r in range(1, 41):                                        # 40 ranks fail alike, 20 vanish
        postmortem.tell(store, 2, r, f"OSError: disk {r}")
    broken = [0, 41, 42, 43]
    for r, (causes, silent, count) in zip(broken, _broken(store, 2, world, broken)):
        assert len(causes) == postmortem.DETAILS and set(causes) <= set(range(1, 41)), r
        assert count == 20 and silent == list(range(44, 44 + postmortem.SHOWN)), r
        message, failures = postmortem.describe("read", r, RuntimeError("lost a peer"), causes, silent, count, None)
        assert f"no word from ranks {', '.join(map(str, silent))} ... (20 in all)" in message
        assert len(failures) == postmortem.DETAILS + postmortem.SHOWN + 1
    assert store.rank_lookups == world - 1


def test_a_lone_broken_rank_still_names_the_silent_peer():
    store = dist.HashStore()
    ((causes, silent, count),) = _broken(store, 3, 2, [0])
    assert (causes, silent, count) == ({}, [1], 1)
