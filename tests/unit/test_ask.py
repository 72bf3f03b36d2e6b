"""`sluice ask` reads the reply partition the workers' producer writes a request's replies to."""

from aiokafka.partitioner import DefaultPartitioner

from loadgen.ask import reply_partition


def test_the_reply_partition_is_the_one_a_keyed_record_goes_to():
    partitioner = DefaultPartitioner()
    for n in (1, 3, 6, 12):
        partitions = set(range(n))
        for i in range(200):
            key = f"req-{i}".encode()
            assert reply_partition(key.decode(), partitions) == partitioner(key, list(range(n)), list(range(n)))
