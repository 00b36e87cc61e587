"""The roles a PD worker hosts, prefill (PD-P) or decode (PD-D): what each is made of, how it is
built over the process's one backend, and how it is closed.

A hosted role owns everything built for it (workers, KV listener, publisher, KV memory) and gives
it all back in :func:`close_role`; the backend is the PD worker's and outlives every role.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from common.model.backend import Backend
from common.rpc.handshake import parse_addr
from common.runtime.backoff import Backoff
from common.worker.bring_up import report_with_publisher, start_kv_publisher
from services.decode.setup import decode_worker_from_args
from services.prefill.setup import prefill_worker_from_args

log = logging.getLogger("prfaas.pd")

KV_BIND_TRIES, KV_BIND_WAIT_S = 20, 0.1  # re-opening --kv-listen: a port just closed may take a moment


class PrefillRole:
    """The prefill role: a prefill worker and its prefix-cache publisher (None without ``--router``)."""

    role = "prefill"

    def __init__(self, worker, publisher):
        self.worker = worker
        self.publisher = publisher
        self.stats = report_with_publisher(worker.stats, publisher)
        self.methods: dict[str, Callable] = {"prefill": worker.prefill, "inject_fault": worker.inject_fault,
                                             "export_prefix": worker.export_prefix}

    def in_flight(self) -> int:
        """Requests computing or waiting for the compute slot."""
        return self.worker.waiting + self.worker.running

    def held_blocks(self) -> int | None:
        return None

    async def close(self) -> None:
        """Close the KV links and peer clients (the publisher is closed by the owner first)."""
        await self.worker.close()


class DecodeRole:
    """The decode role: a KV receiver (listening), a decode worker (batch loop running) and its publisher."""

    role = "decode"

    def __init__(self, receiver, worker, publisher):
        self.receiver = receiver
        self.worker = worker
        self.publisher = publisher
        self.stats = report_with_publisher(worker.stats, publisher)
        self.methods: dict[str, Callable] = {"generate": worker.generate}

    def in_flight(self) -> int:
        """Requests running, swapped out, transferring, joining or queued for KV blocks, plus KV reservations."""
        s = self.worker.stats()
        return int(s["running"]) + int(s["waiting"]) + int(s.get("swapped", 0)) + len(self.receiver.reservations)

    def held_blocks(self) -> int | None:
        """KV blocks held by requests (not counting what only the prefix cache holds)."""
        return int(self.worker.stats()["kv_blocks_held"])

    async def close(self) -> None:
        """Stop listening for KV (aborting any transfer), then stop the batch loop."""
        await self.receiver.close()
        await self.worker.close()


async def build_role(role: str, args: argparse.Namespace, backend: Backend, kv_listen: str) -> PrefillRole | DecodeRole:
    """Build ``role`` over ``backend`` from the PD worker's flags; for decode, open ``kv_listen``
    (host:port; a port just closed is tried again, :data:`KV_BIND_TRIES` times :data:`KV_BIND_WAIT_S`
    seconds apart) and start the batch loop. Raises ``OSError`` when the KV listener cannot bind."""
    if role == "prefill":
        worker = prefill_worker_from_args(args, backend)
        return PrefillRole(worker, start_kv_publisher(args, worker, "prefill", "pd"))
    receiver, worker = decode_worker_from_args(args, backend, kv_listen)
    host, port = parse_addr(kv_listen)
    backoff = Backoff(KV_BIND_WAIT_S, KV_BIND_WAIT_S, factor=1.0)
    while True:
        try:
            await receiver.start(host, port)
            break
        except OSError as e:
            if backoff.attempts >= KV_BIND_TRIES - 1:
                raise
            log.info("KV listener %s not free yet (%s); retrying", kv_listen, e)
            await backoff.sleep()
    worker.start()
    return DecodeRole(receiver, worker, start_kv_publisher(args, worker, "decode", "pd"))


async def close_role(hosted: PrefillRole | DecodeRole, forget: bool) -> None:
    """Close ``hosted``: its publisher first (``forget``: retired, so the router drops the node's
    cached blocks at once, :meth:`KvEventPublisher.retire`), then the rest."""
    if hosted.publisher is not None:
        await (hosted.publisher.retire() if forget else hosted.publisher.close())
    await hosted.close()
