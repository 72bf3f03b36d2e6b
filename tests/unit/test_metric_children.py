"""sluice's Counter and Histogram children skip prometheus-client's per-call checks: the samples they
export are the same as prometheus-client's own for every amount, and misuse still raises."""

import math

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from worker import metrics

BUCKETS = (0.01, 0.1, 1, 10)
AMOUNTS = [0.0, 0.005, 0.01, 0.0100001, 0.1, 0.5, 1, 1.0, 9.999, 10, 10.5, 1e9, math.inf, -1.0, math.nan]


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict, float]]:
    out = []
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.append((s.name, s.labels, "nan" if s.value != s.value else s.value))
    return sorted(out, key=repr)


@pytest.mark.parametrize("amounts", [[a] for a in AMOUNTS] + [AMOUNTS])
def test_histogram_child_exports_what_prometheus_client_exports(amounts):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h1 = metrics.Histogram("h", "h", ["class"], buckets=BUCKETS, registry=ours)
    h2 = prometheus_client.Histogram("h", "h", ["class"], buckets=BUCKETS, registry=theirs)
    for a in amounts:
        h1.labels("standard").observe(a)
        h2.labels("standard").observe(a)
    assert _samples(ours) == _samples(theirs)


@pytest.mark.parametrize("amount", [0, 1, 2.5, 1e12, math.inf, math.nan])
def test_counter_child_and_unlabelled_counter_count_as_prometheus_client(amount):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    for registry, cls in ((ours, metrics.Counter), (theirs, prometheus_client.Counter)):
        cls("c", "c", ["class"], registry=registry).labels("batch").inc(amount)
        plain = cls("u", "u", registry=registry)
        plain.inc()
        plain.inc(amount)
    assert _samples(ours) == _samples(theirs)


def test_misuse_still_raises():
    registry = CollectorRegistry()
    counter = metrics.Counter("c", "c", ["class"], registry=registry)
    histogram = metrics.Histogram("h", "h", ["class"], registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("batch").inc(-1)
    with pytest.raises(ValueError):
        counter.inc()  # a labelled metric's parent is not observable
    with pytest.raises(ValueError):
        histogram.observe(1.0)
