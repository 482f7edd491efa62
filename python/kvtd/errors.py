"""Exceptions of the kvtd client. Every one carries the library's code (`code`, `code_name`)."""

from __future__ import annotations

from . import _native as n


class KvtdError(Exception):
    """A kvtd call failed; `code` is the KVTD_E_* value, `code_name` its name."""

    code = n.E_SYSTEM

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def code_name(self) -> str:
        return n.error_name(self.code)


class InvalidArgument(KvtdError, ValueError):
    code = n.E_INVALID


class Timeout(KvtdError, TimeoutError):
    code = n.E_TIMEOUT


class RingFull(KvtdError):
    code = n.E_RING_FULL


class NotReady(KvtdError):
    code = n.E_NOT_READY


class UnknownTask(KvtdError, KeyError):
    code = n.E_UNKNOWN_TASK

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


class InUse(KvtdError):
    code = n.E_IN_USE


class SystemFailure(KvtdError, OSError):
    code = n.E_SYSTEM


class TaskFailed(KvtdError):
    """The task completed with a failure on some rank. `result` is the merged TaskResult:
    its status/status_name/failed_rank/message name the lowest failing rank's cause, and the
    task's destination blocks must be treated as not written."""

    code = n.E_TASK_FAILED

    def __init__(self, result):
        super().__init__(f"task {result.task_id} failed: {result.status_name} ({result.message})")
        self.result = result


class CacheCleared(KvtdError):
    """The cache is cleared for a weight update: restore_caches() first."""

    code = n.E_CACHE_CLEARED


class CacheControlFailed(KvtdError):
    """clear_caches() or restore_caches() failed on a rank (the message names it and the cause);
    the cache stays cleared."""

    code = n.E_TASK_FAILED


class Closed(KvtdError):
    """The session was closed while this call waited in it (another thread called close())."""

    code = n.E_CLOSED


class WrongProcess(KvtdError):
    """The session belongs to the process that created it; a forked child must make its own."""

    code = n.E_WRONG_PROCESS


_BY_CODE = {c.code: c for c in (InvalidArgument, Timeout, RingFull, NotReady, UnknownTask, InUse, SystemFailure,
                                CacheCleared, Closed, WrongProcess)}


def raise_for(code: int, message: str):
    cls = _BY_CODE.get(code, KvtdError)
    raise cls(message, code)
