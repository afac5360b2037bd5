"""The hang watch's verdicts (runtime/watchdog.py), on heartbeats written into a store by hand and a clock moved by
hand: a rank behind the others while nobody moves, a stopped heartbeat, and what is not a hang (a rank saving, every
rank at the same collective, a rank that left the run). (The watch under torchrun: tests/distributed/test_faults.py.)
"""

from __future__ import annotations

import pytest

from mindspeed_hf.runtime import watchdog


class Store:
    """The few store calls the watch makes, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data[k] for k in keys]

    def compare_set(self, key, expected, desired):
        if key not in self.data and expected == "":
            self.data[key] = desired.encode()
        return self.data[key]


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    return now


def _watch(rank: int, world: int, store: Store, bound: float = 10) -> watchdog._Watch:
    watch = watchdog._Watch()
    watch.store, watch.rank, watch.world, watch.bound = store, rank, world, bound
    return watch


def _beat(store: Store, rank: int, beat: int, count: int, step: int = 3, saving: int = 0, where: str = "x.py:1 (f)"):
    store.set(str(rank), f"{beat}|{count}|{step}|{saving}|{where}")


def test_a_rank_behind_while_nobody_moves_is_named(clock):
    store, seen = Store(), {}
    watch = _watch(0, 3, store)
    for t in range(4):  # ranks 0 and 2 wait in collective 12; rank 1 never joined it (11 issued); all alive
        _beat(store, 0, t, 12)
        _beat(store, 1, t, 11, where="train.py:42 (load_batch)")
        _beat(store, 2, t, 12)
        verdict = watch._check(seen)
        if t < 3:  # within the bound
            assert verdict is None, t
        clock[0] += 4
    speaker, _, line = verdict.partition("|")
    assert speaker == "0" and line.startswith("rank 1 stopped answering at step 3: the other ranks have waited 12 s "
                                              "in a collective it never joined (parallel.collective_timeout=10)")
    assert "rank 1 is at train.py:42 (load_batch)" in line
    assert _watch(2, 3, store)._check({}) == verdict  # every rank finds the claimed verdict


@pytest.mark.parametrize("case", ["saving", "same collective", "moving", "left"])
def test_what_is_not_a_hang(clock, case):
    store, seen = Store(), {}
    watch = _watch(0, 2, store)
    for t in range(6):
        count = 12 + (t if case == "moving" else 0)
        _beat(store, 0, t, count, saving=1 if case == "saving" else 0)
        _beat(store, 1, t, count if case in ("same collective", "moving") else 11)
        if case == "left" and t >= 1:  # rank 1 finished training (it disarmed): the run is ending
            store.set("1", "done")
        assert watch._check(seen) is None, t
        clock[0] += 4


def test_a_stopped_heartbeat_is_named_and_rank_0_is_watched_by_rank_1(clock):
    store = Store()
    watch0, seen0 = _watch(0, 2, store), {}
    watch1, seen1 = _watch(1, 2, store), {}
    for t in range(3):  # rank 1's heartbeat stops (its process is frozen) while rank 0 waits
        _beat(store, 0, t, 12)
        if t == 0:
            _beat(store, 1, 0, 11)
        assert watch0._check(seen0) is None
        clock[0] += 4
    _beat(store, 0, 5, 12)
    line = watch0._check(seen0).partition("|")[2]
    assert line.startswith("rank 1 stopped answering at step 3: no heartbeat for over 10 s"), line
    store2 = Store()  # rank 0's own heartbeat stopping: rank 1 says it
    for t in range(3):
        _beat(store2, 1, t, 12)
        if t == 0:
            _beat(store2, 0, 0, 12)
        watch1.store = store2
        assert watch1._check(seen1) is None
        clock[0] += 4
    _beat(store2, 1, 5, 12)
    assert watch1._check(seen1).startswith("1|rank 0 stopped answering")
