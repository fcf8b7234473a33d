"""Which ranks a failed agreement names (autofit.distributed.presence.Presence.failed), on a store
made by hand: only ranks the evidence shows failed, never this rank, never a healthy rank that is
merely behind; the spawned tests (test_rank_evidence.py) kill real ranks."""

from __future__ import annotations

import itertools

import pytest

from autofit.distributed import presence as presence_module
from autofit.distributed.presence import Presence


class _Store:
    """A dict store; `beating` ranks' heartbeats move at every read, `gone` makes every call fail."""

    def __init__(self, beating=(), gone=False):
        self.data, self.beating, self.gone = {}, set(beating), gone
        self.ticks = itertools.count()

    def _check_gone(self):
        if self.gone:
            raise ConnectionError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def set(self, key, value):
        self._check_gone()
        self.data[key] = value

    def check(self, keys):
        self._check_gone()
        return all(k in self.data or self._beat(k) is not None for k in keys)

    def _beat(self, key):
        if "/beat/" in key and int(key.rsplit("/", 1)[1]) in self.beating:
            return str(next(self.ticks))
        return None

    def get(self, key):
        self._check_gone()
        return (self._beat(key) or self.data[key]).encode()


def _presence(rank, store, host=None, world=3):
    p = Presence(rank, 1, lambda step, phase: f"at global step {step}, phase {phase}")  # no store yet
    p.world, p.store, p.host = world, store, host
    return p


@pytest.fixture(autouse=True)
def _short_watch(monkeypatch):
    monkeypatch.setattr(presence_module, "DEAD_S", 0.3)
    monkeypatch.setattr(presence_module, "LOOK_S", 0.05)


def _records(p, store, entered):
    """Each rank's record: `entered[r]` agreements entered, at global step 2, phase 3."""
    for r, n in entered.items():
        store.data[f"{p.prefix}at/{r}"] = f"{n} 2 3"
        store.data[f"{p.prefix}beat/{r}"] = "0"


def test_a_dead_rank_is_named_and_a_live_rank_behind_is_not_after_a_closed_connection():
    store = _Store(beating={2})
    p = _presence(0, store)
    p.entered = 5
    _records(p, store, {1: 4, 2: 4})  # both behind: rank 1 dead, rank 2 alive (slow in forward)
    assert p.failed(timed_out=False) == [
        (1, "died or froze: its heartbeat stopped; it was last at global step 2, phase 3")]


def test_after_the_timeout_a_live_rank_behind_is_named_as_stalled():
    store = _Store(beating={2})
    p = _presence(0, store)
    p.entered = 5
    _records(p, store, {1: 5, 2: 4})  # rank 1 reached the agreement but died in it
    assert p.failed(timed_out=True) == [
        (1, "died or froze: its heartbeat stopped; it was last at global step 2, phase 3"),
        (2, "stalled: its heartbeat goes on but it did not reach the agreement; it was last at global "
            "step 2, phase 3")]


def test_a_rank_that_left_the_run_is_not_named_and_no_rank_names_itself():
    store = _Store(beating=set())
    p = _presence(1, store)
    p.entered = 5
    _records(p, store, {0: 5, 1: 5, 2: 4})
    store.data[f"{p.prefix}left/0"] = "1"  # ended its run knowingly: stopped beating, not dead
    assert p.failed(timed_out=False) == [
        (2, "died or froze: its heartbeat stopped; it was last at global step 2, phase 3")]


def test_a_store_that_closed_names_the_rank_serving_it_unless_that_is_this_rank():
    assert _presence(1, _Store(gone=True), host=0).failed(timed_out=False) == [
        (0, "died: the store it serves closed its connection")]
    assert _presence(0, _Store(gone=True), host=0).failed(timed_out=False) == []
    assert _presence(1, _Store(gone=True), host=None).failed(timed_out=False) == []


def test_without_a_store_no_rank_is_named():
    assert _presence(0, None).failed(timed_out=True) == []


def test_another_ranks_verdict_in_the_store_is_taken_unless_it_names_this_rank():
    store = _Store(beating={0, 2})
    p = _presence(2, store)
    store.data[f"{p.prefix}stopped"] = "0|1|rank 1 died or froze: its heartbeat stopped"
    assert p.failed(timed_out=False) == [(1, "rank 1 died or froze: its heartbeat stopped")]
    store.data[f"{p.prefix}stopped"] = "0|2|rank 2 stalled"
    p.entered = 5
    _records(p, store, {0: 5, 1: 5})
    assert p.failed(timed_out=False) == [
        (1, "died or froze: its heartbeat stopped; it was last at global step 2, phase 3")]
