"""One partition as aiokafka's consumer reads it with `auto_offset_reset="none"`, for the readers that
handle a position out of range themselves (the backfill's output scan, the dead-letter listing)."""

from aiokafka.errors import OffsetOutOfRangeError


class RetainedPartition:
    """`records` from offset 0, of which retention has removed those below `log_start`: a position
    below the first record left, or past the end, raises. Once reading reaches `moves_at`, retention
    removes every record below `moves_to`, as it may while a long read runs. Each read returns up to
    `per_read` records."""

    def __init__(self, records: list, log_start: int = 0, moves_at: int | None = None, moves_to: int = 0,
                 per_read: int = 4):
        self.records, self.log_start, self.per_read = records, log_start, per_read
        self.moves_at, self.moves_to = moves_at, moves_to
        self.position_of: dict = {}

    def assign(self, tps) -> None:
        self.assigned = list(tps)

    def seek(self, tp, offset: int) -> None:
        self.position_of[tp] = offset

    async def beginning_offsets(self, tps) -> dict:
        return {tp: self.log_start for tp in tps}

    async def position(self, tp) -> int:
        return self.position_of[tp]

    async def getmany(self, *tps, timeout_ms: int = 0) -> dict:
        (tp,) = tps
        at = self.position_of[tp]
        if self.moves_at is not None and at >= self.moves_at:
            self.log_start, self.moves_at = self.moves_to, None
        if at < self.log_start or at > len(self.records):
            raise OffsetOutOfRangeError({tp: at})
        got = self.records[at: at + self.per_read]
        self.position_of[tp] = at + len(got)
        return {tp: got} if got else {}
