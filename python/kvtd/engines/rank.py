"""The wing's shared rank layer: what every engine adapter does for one rank of its engine.

- `open_rank_session`: one rank's session, its tensors registered, published; on any failure
  closed again, so nothing half-made is left in /dev/shm for a daemon to attach to.
- `daemon_command`: the command line of that rank's daemon, from the session's geometry (storage
  and log flags are the operator's to add).
- A task's end, never TaskFailed: `task_outcome` (bounded: past its time the task is cancelled and
  its final answer awaited, so no copy of it runs afterwards and the engine may reuse its blocks),
  `polled_outcome` (without blocking) and `refused_outcome` (a task the session would not submit).

The session's name is the adapter's to make: it must carry every rank coordinate its engine has
(TP, and PP, CP or a DP group where the engine has them), or two ranks meet in one session.
Tensors are named to the daemon by `kvtd.places` (a CUDA IPC handle, a /dev/shm object, a memfd).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional

from ..errors import KvtdError, Timeout
from ..geometry import Geometry
from ..session import Session, TaskResult


@dataclasses.dataclass(frozen=True)
class RankTensor:
    """One tensor of a rank as the daemon opens it: layer and kind in the geometry, its place
    (a 64-byte handle and byte offset, from kvtd.places), its size and CUDA device (-1: host)."""

    layer: int
    kind: object
    handle: bytes
    offset: int
    nbytes: int
    device: int = -1


def open_rank_session(suffix: str, geometry, rank: int, tensors: Iterable[RankTensor], *,
                      weight_version: Optional[int] = None, **session_options) -> Session:
    """A published session `suffix` over `geometry` (a Geometry, or CacheGroups: then a tensor's
    kind is its registry slot) holding rank `rank`'s tensors (session_options go to Session:
    only_rank, adopt_host_tier). Raises, with the session closed, when any step fails."""
    s = (Session(suffix, geometry, **session_options) if isinstance(geometry, Geometry)
         else Session(suffix, groups=geometry, **session_options))
    try:
        for t in tensors:
            s.register_tensor(rank, t.layer, t.kind, t.handle, t.offset, t.nbytes, device_id=t.device)
        if weight_version is not None:
            s.set_weight_version(weight_version)
        s.publish()
    except BaseException:
        s.close()
        raise
    return s


def daemon_command(geometry, suffix: str, rank: int, device: int = -1) -> List[str]:
    """`kvtd` with the flags that make rank `rank`'s daemon agree with `geometry` (a Geometry or
    CacheGroups) and find session `suffix`: the CUDA backend on `device`, or the host backend for
    device -1."""
    backend = ["--device-backend", "cuda", "--device-id", str(device)] if device >= 0 else ["--device-backend", "host"]
    flags = geometry.daemon_flags()
    if "--mp-num" not in flags:  # cache groups name their groups only
        flags = ["--mp-num", str(geometry.num_ranks), *flags]
    return ["kvtd", "--session", suffix, "--rank", str(rank), *backend, *flags]


def task_outcome(session: Session, task_id: int, *, timeout: Optional[float] = None, cancel: bool = False,
                 log_every: float = 60.0) -> TaskResult:
    """Task `task_id`'s final result. Within `timeout` seconds when one is given, else cancelled
    and its final answer awaited; cancelled at once when `cancel` (the caller gave up on it).
    Either way the answer is final: no copy of the task runs after it, so the engine may reuse
    the task's blocks. Waits as long as the daemons live (a dead daemon ends its tasks), logging
    every `log_every` s. Never raises TaskFailed; a session that cannot be asked raises KvtdError."""
    if timeout is not None and not cancel:
        try:
            return session.wait(task_id, timeout, check=False)
        except Timeout:
            cancel = True
    return session.final_result(task_id, cancel=cancel, timeout_each=log_every)


def polled_outcome(session: Session, task_id: int) -> Optional[TaskResult]:
    """Task `task_id`'s merged result once every rank reported it, else None, without blocking. A
    session that cannot be polled (its daemon died) answers with the task's final result, which
    ends with the daemon."""
    try:
        return session.poll(task_id, check=False)
    except KvtdError:
        return session.final_result(task_id, cancel=False)


def refused_outcome(error: KvtdError) -> TaskResult:
    """The result of a task the session refused to submit (a rank not ready, the cache cleared):
    no task id, no rank, the refusal's code and message."""
    return TaskResult(task_id=0, status=-1, status_name=error.code_name, failed_rank=-1, blocks_done=0,
                      blocks_skipped=0, latency_ns=0, message=str(error))
