"""CPU cores shared by the model workers of one machine: each compute call leases cores, so the
worker that is busy gets them all and two busy workers split them, instead of a fixed thread count.

Mechanism: one lock file per core in a directory every worker of the machine names the same
(``$PRFAAS_CORES_DIR``, else a folder under the system's temporary directory); a lease holds
``flock(LOCK_EX)`` on the files of the cores it took, and the call runs with that many torch threads.
The kernel drops a dead process's locks, so a killed worker leaks no core.

Policy (:meth:`CoreShare.acquire`):
- each role has a home core: decode the first, prefill the last. A lease waits for its home core
  (a decode step waits at most for one prefill layer that took it; two decode workers take turns);
- it then takes every other core that is free at that moment, unless a worker of the other role is
  busy: a decode worker with running rows, a prefill worker inside a prefill (each holds a shared
  lock on ``decode-busy`` / ``prefill-busy`` meanwhile). So one busy side gets every core, and when
  both are busy each keeps its home core, neither waiting on the other's steps or layers.

A decode step of this model is bound by memory bandwidth at batch 1 and by compute at larger
batches; a prefill is compute-bound: both gain from a second core when the other side is idle.

The leases count only the workers that share the directory. On a machine where other busy processes
take the cores, a two-thread compute region waits for whichever thread the kernel descheduled (a
lean decode step at batch 16 ran 6x slower on two threads than on one under such load, here): give
such a deployment a fixed ``--threads 1``.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ROLES = ("decode", "prefill")
OTHER = {"decode": "prefill", "prefill": "decode"}


def default_dir() -> str:
    """``$PRFAAS_CORES_DIR``, else ``<tmp>/prfaas-cores-<uid>``."""
    return os.environ.get("PRFAAS_CORES_DIR") or os.path.join(tempfile.gettempdir(), f"prfaas-cores-{os.getuid()}")


class CoreShare:
    """Leases of ``cores`` cores among processes that use the same ``directory``.

    ``cores`` defaults to the cores this process may run on (``os.sched_getaffinity``). Thread-safe:
    this process's leases run one at a time (a lease is not re-entrant).
    """

    def __init__(self, directory: str | None = None, cores: int | None = None):
        self.directory = directory or default_dir()
        self.cores = cores or len(os.sched_getaffinity(0))
        os.makedirs(self.directory, exist_ok=True)
        self._fds = [self._open(f"core-{i}") for i in range(self.cores)]
        self._busy_fds = {role: self._open(f"{role}-busy") for role in ROLES}
        self._local = threading.Lock()  # this process's leases take cores one at a time
        self._busy_held = {role: False for role in ROLES}

    def _open(self, name: str) -> int:
        return os.open(os.path.join(self.directory, name), os.O_RDWR | os.O_CREAT, 0o666)

    def home(self, role: str) -> int:
        """The core a role's lease waits for: decode the first, prefill the last."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        return 0 if role == "decode" else self.cores - 1

    def acquire(self, role: str) -> list[int]:
        """Take cores for one compute call (see the module's policy) and set torch's thread count to
        their number; returns the cores held, to give to :meth:`release`. Blocks for the role's home core."""
        home = self.home(role)
        self._local.acquire()  # flock is per open file: this process's leases must not share a core
        try:
            fcntl.flock(self._fds[home], fcntl.LOCK_EX)
        except BaseException:
            self._local.release()
            raise
        held = [home]
        if not self._busy(OTHER[role]):
            held += [i for i in range(self.cores) if i != home and self._try(i)]
        torch.set_num_threads(len(held))
        return held

    def release(self, held: list[int]) -> None:
        """Give back the cores of one :meth:`acquire`."""
        for i in held:
            fcntl.flock(self._fds[i], fcntl.LOCK_UN)
        self._local.release()

    @contextmanager
    def lease(self, role: str) -> Iterator[int]:
        """:meth:`acquire` for the body of a ``with``; yields how many cores (torch threads) it holds."""
        held = self.acquire(role)
        try:
            yield len(held)
        finally:
            self.release(held)

    def _try(self, i: int) -> bool:
        try:
            fcntl.flock(self._fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _busy(self, role: str) -> bool:
        """Whether any worker marked ``role`` busy (a shared lock held); this process's own mark counts."""
        if self._busy_held[role]:
            return True
        fd = self._busy_fds[role]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def set_busy(self, role: str, busy: bool) -> None:
        """Mark this process busy in ``role`` (a decode worker with running rows, a prefill under way)
        or not: the other role's leases then take only their home core."""
        if busy == self._busy_held[role]:
            return
        fcntl.flock(self._busy_fds[role], fcntl.LOCK_SH if busy else fcntl.LOCK_UN)
        self._busy_held[role] = busy

    def close(self) -> None:
        for fd in [*self._fds, *self._busy_fds.values()]:
            os.close(fd)
        self._fds = []
