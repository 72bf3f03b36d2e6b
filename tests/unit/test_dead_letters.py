import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from schemas import dlq
from tests.unit.retained import RetainedPartition
from worker.dead_letters import DeadLetter, ListingBroken, read_range

REQUESTS = {"sluice.requests.standard"}


def letter(key=b"k", value=b"{}", source=("sluice.requests.standard", 0, 7), extra=()):
    hdrs = [("x-sluice-signature", b"k1:abc")] + dlq.headers("invalid_request", "why", *source) + list(extra)
    return DeadLetter(0, 3, 1_764_892_800_000, key, value, tuple(hdrs))


@pytest.mark.parametrize("what,dead,why", [
    ("whole", letter(), None),
    ("keyless, with a value", letter(key=None), None),
    ("cut to fit", letter(extra=[(dlq.TRUNCATED, b"value=2000000,key=1,headers=0:0")]), "cut to fit"),
    ("unreadable by the client", letter(key=None, value=b""), "could not read it"),
    ("from a topic not the workers'", letter(source=("sluice.replies", 0, 1)), "not a request topic"),
    ("no source", DeadLetter(0, 1, 0, b"k", b"{}", (("x-sluice-error-code", b"invalid_request"),)), "no source"),
])
def test_only_a_whole_dead_letter_of_a_request_topic_is_published_again(what, dead, why):
    found = dead.why_not_replayable(REQUESTS)
    assert (found is None) if why is None else (why in found), (what, found)


def test_a_replay_carries_the_records_own_headers_and_none_of_the_dead_letters():
    assert dlq.own_headers(letter().headers) == [("x-sluice-signature", b"k1:abc")]


def test_a_line_names_when_where_why_and_the_start_of_the_bytes():
    line = letter(value=b'{"prompt": "x"}').line()
    assert line.startswith("2025-12-05T00:00:00Z  sluice.requests.standard:0:7  invalid_request: why")
    assert "key='k'" in line and "value=b'{\"prompt\": \"x\"}'" in line


DLQ = TopicPartition("sluice.dlq", 0)


def dead_letter_partition(records: int, log_start: int = 0, moves_at: int | None = None, moves_to: int = 0):
    return RetainedPartition([ConsumerRecord(DLQ.topic, 0, o, 0, 0, b"k", b"{}", None, 1, 2, ()) for o in range(records)],
                             log_start, moves_at, moves_to, per_read=3)


@pytest.mark.parametrize("lo, hi, log_start, moves_at, moves_to, listed, removed", [
    (0, 10, 0, None, 0, range(0, 10), 0),  # nothing removed: all listed
    (2, 10, 0, 3, 7, [2, 3, 4] + list(range(7, 10)), 2),  # retention took 5-6 while the listing read 2-4
    (0, 6, 0, 3, 9, [0, 1, 2], 3),  # retention passed the listing's end: 3-5 removed, nothing more read
])
async def test_a_listing_counts_what_retention_removed_while_it_read_and_goes_on(lo, hi, log_start, moves_at,
                                                                                 moves_to, listed, removed):
    partition, seen = dead_letter_partition(10, log_start, moves_at, moves_to), []
    assert await read_range(partition, DLQ, lo, hi, lambda rec: seen.append(rec.offset)) == removed
    assert seen == list(listed)  # the client's default reset ("latest") would have ended at the first removal


async def test_a_listing_whose_partition_was_created_again_stops_with_why():
    partition = dead_letter_partition(4)
    partition.records = partition.records[:2]  # the topic created again, shorter: offset 3 is past its end
    with pytest.raises(ListingBroken, match="created again"):
        await read_range(partition, DLQ, 3, 4, lambda rec: None)
