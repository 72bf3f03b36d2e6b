"""The overhead bench's count of full garbage collections: only the oldest generation, only while open."""

import gc

from bench.overhead import FullCollections


def test_counts_full_collections_only_while_open():
    with FullCollections() as full:
        gc.collect(0)
        gc.collect(1)
        assert full.count == 0
        gc.collect()
        gc.collect(2)
    gc.collect()
    assert full.count == 2
    assert full.seconds >= full.longest > 0
    assert full._watch not in gc.callbacks
