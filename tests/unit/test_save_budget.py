"""The KV-page save budget as a table: (seconds since the last call, pages asked) -> pages granted."""

import pytest

from worker.save_budget import MIB, SaveBudget

PAGE = 100


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("bytes_per_s, steps", [
    # no budget: everything, always
    (0, [(0, 5, 5), (0, 1000, 1000), (0, 0, 0)]),
    # 3 pages a second, a second's burst: 3 at once, then what a refill pays for
    (300, [(0, 5, 3), (0, 1, 0), (0.5, 2, 1), (0.5, 5, 2), (10, 9, 3)]),
    # refill is pro rata and carries over fractions of a page
    (100, [(0, 1, 1), (0.4, 1, 0), (0.4, 1, 0), (0.4, 1, 1)]),
    # a budget below one page a second still holds one page, else no page could ever be saved
    (10, [(0, 3, 1), (5, 1, 0), (5, 1, 1)]),
    # asking for nothing takes nothing
    (300, [(0, 0, 0), (0, 3, 3)]),
])
def test_grants_follow_the_bucket(bytes_per_s, steps):
    clock = Clock()
    budget = SaveBudget(bytes_per_s, PAGE, clock=clock)
    for wait, asked, granted in steps:
        clock.now += wait
        assert budget.grant(asked) == granted, (wait, asked)


def test_settings_are_mebibytes_per_second():
    clock = Clock()
    budget = SaveBudget.from_settings(2.5, MIB, clock=clock)
    assert budget.grant(10) == 2
    clock.now += 1
    assert budget.grant(10) == 2  # the bucket holds a second's budget at most (2.5 MiB), not 3 MiB


def test_a_longer_burst_keeps_unused_budget_for_an_occasional_long_prompt():
    clock = Clock()
    budget = SaveBudget.from_settings(1, MIB, 30, clock=clock)
    assert budget.grant(40) == 30  # a full bucket: 30 s of budget at once
    clock.now += 1
    assert budget.grant(40) == 1  # then the rate
    clock.now += 100
    assert budget.grant(40) == 30  # a quiet spell refills it to the burst, no further


@pytest.mark.parametrize("bytes_per_s, page_bytes, burst_s", [(-1, PAGE, 1), (100, 0, 1), (100, PAGE, 0)])
def test_nonsense_is_refused(bytes_per_s, page_bytes, burst_s):
    with pytest.raises(ValueError):
        SaveBudget(bytes_per_s, page_bytes, burst_s)


def test_the_connector_builds_its_budget_from_the_kv_settings_and_the_engines_page_size():
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from worker.kv_connector import SluiceKVConnector
    from worker.settings import KvSettings

    page = SimpleNamespace(page_size_bytes=MIB // 4)  # per layer: a whole page of 2 layers is half a MiB
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=page)])
    kv = KvSettings(save_budget_mib_s=2, save_burst_s=30)
    budget = SluiceKVConnector._save_budget(kv, KVConnectorRole.SCHEDULER, config)
    assert budget.page_bytes == MIB // 2 and budget.bytes_per_s == 2 * MIB
    assert budget.capacity == 60 * MIB  # 30 s of 2 MiB/s kept
    assert SluiceKVConnector._save_budget(kv, KVConnectorRole.WORKER, config) is None  # the scheduler side plans saves
    assert SluiceKVConnector._save_budget(KvSettings(), KVConnectorRole.SCHEDULER, config) is None  # no budget set


@pytest.mark.parametrize("candidates, order", [
    ([], []),
    # the longest still to run first: its pages insure the most
    ([("a", 3), ("b", 90), ("c", 10)], ["b", "c", "a"]),
    # ties keep the scheduler's order (running requests are listed before new ones)
    ([("running", 5), ("new", 5), ("other", 0)], ["running", "new", "other"]),
    # a request with nothing left to generate comes last
    ([("done", 0), ("long", 1)], ["long", "done"]),
])
def test_the_budget_pays_first_for_the_requests_with_most_still_to_generate(candidates, order):
    from worker.save_budget import save_order

    assert save_order(candidates) == order
