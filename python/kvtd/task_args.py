"""What a task's arguments become on the C ABI, checked (block ids, keys, timeouts, integers),
and the merged result a task comes back as."""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Iterable, Optional, Sequence

from . import _native as n


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """The merged completion of a task: ok only if every rank succeeded; blocks_done is the MIN
    over ranks; on failure, status/failed_rank/message are the lowest failing rank's."""

    task_id: int
    status: int
    status_name: str
    failed_rank: int
    blocks_done: int
    blocks_skipped: int
    latency_ns: int
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 0

    @staticmethod
    def _from(c: n.Completion, message: str = "") -> "TaskResult":
        return TaskResult(c.task_id, c.status, n.status_name(c.status), c.failed_rank, c.blocks_done,
                          c.blocks_skipped, c.latency_ns, message)


_ID_LIMIT = 2**31  # block ids are int32 on the wire


def block_ids(values: Optional[Iterable[int]], what: str, allow_none: bool = False):
    """Block ids as an int32 array. One outside [0, 2**31) is refused: ctypes would wrap it onto
    another block (2**32 + 5 is block 5) and the task would move that block and answer ok.
    `allow_none`: -1 stands for no block (a group session's storage task)."""
    if values is None:
        return None, 0
    seq = list(values)
    if seq:
        try:
            lo, hi = min(seq), max(seq)
        except TypeError:
            lo = hi = None
        if lo is None or lo < (-1 if allow_none else 0) or hi >= _ID_LIMIT:
            for i, v in enumerate(seq):
                if isinstance(v, float) or not ((allow_none and v == -1) or 0 <= v < _ID_LIMIT):
                    raise ValueError(f"{what}[{i}] = {v!r} is not a block id in [0, 2**31)")
    return (ctypes.c_int32 * len(seq))(*seq), len(seq)


def key_bytes(keys: Sequence) -> list:
    """Keys as C strings. A key holding a NUL byte is refused: C would cut it there, so b"kx\0A"
    and b"kx\0B" would name one stored object."""
    out = []
    for i, k in enumerate(keys):
        b = k.encode() if isinstance(k, str) else bytes(k)
        if b"\0" in b:
            raise ValueError(f"key {i} ({b[:40]!r}) holds a NUL byte")
        out.append(b)
    return out


_FOREVER_MS = 2**62  # the library saturates it to "forever"


def milliseconds(seconds: Optional[float]) -> int:
    """Seconds as the library's int64 milliseconds: None and inf wait forever, a huge value is
    forever too (it used to wrap in ctypes' int64 and time out at once), NaN is refused."""
    if seconds is None:
        return _FOREVER_MS
    seconds = float(seconds)
    if math.isnan(seconds):
        raise ValueError("a timeout must be a number of seconds (or None / inf for no limit), not NaN")
    if seconds * 1000 >= _FOREVER_MS:
        return _FOREVER_MS
    return max(0, int(seconds * 1000))


def u64(value: int, what: str, limit: int = 2**62) -> int:
    """A non-negative integer below `limit` (ctypes would wrap a negative or huge one silently)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value >= limit:
        raise ValueError(f"{what} must be an integer in [0, {limit}), got {value!r}")
    return value


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock of `deadline_ns` (time.monotonic_ns() on Linux)."""
    return n.lib.kvtd_now_ns()
