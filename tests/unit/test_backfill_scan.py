"""A resumed backfill reads its output for results written after its checkpoint. Where the output's
retention removed the first of them, the scan starts at the first record left: a jump to the
partition's end (the Kafka client's reset) would miss the rest, and the job would write them twice."""

import msgspec
import pytest
from aiokafka.errors import OffsetOutOfRangeError
from aiokafka.structs import ConsumerRecord, TopicPartition

import topics
from schemas.events import BackfillResult
from tests.unit.retained import RetainedPartition
from worker.backfill import JOB_HEADER, SOURCE_HEADER, Backfill, Job, OutputUnreadable
from worker.settings import load

JOB = Job(source="payments.tx", out="payments.scored", template="fraud", name="june")
OUT = TopicPartition(JOB.out, 0)


def output_reader(results: int, log_start: int, moves_at: int | None = None, moves_to: int = 0):
    """The job's output partition holding `results` results; see RetainedPartition."""
    enc = msgspec.json.Encoder()
    records = [
        ConsumerRecord(JOB.out, 0, o, 0, 0, f"e{o}".encode(),
                       enc.encode(BackfillResult(event_id=f"e{o}", topic=JOB.source, partition=0, offset=o,
                                                 template="fraud", label="ok")), None, 0, 0,
                       ((JOB_HEADER, JOB.id.encode()), (SOURCE_HEADER, f"0:{o}".encode())))
        for o in range(results)]
    return RetainedPartition(records, log_start, moves_at, moves_to)


@pytest.mark.parametrize("scan_from, log_start, moves_at, moves_by, found", [
    (0, 0, None, 0, range(0, 10)),  # the whole output kept: every result found
    (2, 5, None, 0, range(5, 10)),  # retention took 0-4: the rest is found, not skipped
    (0, 0, 4, 6, [0, 1, 2, 3] + list(range(6, 10))),  # retention took 0-5 during the scan
])
async def test_the_scan_finds_every_result_still_in_the_output(tmp_path, scan_from, log_start, moves_at, moves_by,
                                                              found):
    backfill = Backfill(load(environ={}), topics.load(), JOB, state_dir=tmp_path, lease=False)
    reader = output_reader(10, log_start, moves_at, moves_by)
    await backfill._scan_out(reader, {0: scan_from}, {0: 10})
    assert sorted(o for _, o in backfill._landed) == list(found)


async def test_an_offset_out_of_range_above_the_first_record_stops_the_scan(tmp_path):
    backfill = Backfill(load(environ={}), topics.load(), JOB, state_dir=tmp_path, lease=False)
    reader = output_reader(10, 0)

    async def topic_created_again(*tps, timeout_ms=0):
        raise OffsetOutOfRangeError({OUT: 7})

    reader.getmany = topic_created_again
    with pytest.raises(OutputUnreadable, match="deleted and created again"):
        await backfill._scan_out(reader, {0: 7}, {0: 10})
