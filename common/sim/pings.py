"""The KV senders' RTT probes on simulated time: one ping train per connection of each sender path (a
prefill worker's connections to one decode worker), as ``common/transfer/sender.py`` pings.

The real sender pings each connection every ``ping_interval`` seconds, one ping outstanding per
connection, and folds every round trip into its link's smoothed RTT (``Ewma``, alpha 0.125) and its
connection's RTT floor (the lowest of the last few seconds, ``WindowedMin``; without a pong there, the
age of its ping still out); the link's floor is the worst connection's (``LinkStats.rtt_floor``). The
real link pings its idle connections too, so a path that joins starts with a pong at the base on
each connection. A ping waits behind the bytes buffered on
its own connection, so what it measures depends on where the sender put them (:func:`send_shares`,
:func:`connection_ahead`): ``KvLink.send`` places each chunk of one layer's ``send`` on the live
connection with the fewest queued bytes (ties to the first), and a connection's queued count covers
the chunks its writer has not yet drained, including those just placed (with room in the gate and no
codec, ``send`` does not yield between chunks, so no writer runs meanwhile). One send's chunks thus
spread over up to ``connections`` connections (a K and a V range per KV head: every connection of
the path carries bytes), a one-chunk send goes to the first connection, and each send starts again
from empty queues (the writers drain into buffers with room between layers). A connection whose
buffers are full keeps its count above zero (its writer waits in ``drain``), so the chunks go on to
the others: :func:`connection_ahead` fills no connection past its share of the path's buffers.
Between reports :class:`ConnQueues` keeps what each connection holds: new bytes enter by those shares
and the delivered ones leave the connections in turn, so the one given fewer bytes runs dry first.
The link's token bucket serves the connections in turn, so a ping behind ``B_k`` bytes comes back
once its connection sent them, while every other connection sent as much of its own, up to ``B_k``:
the ping is through when the path has delivered that many more bytes, at whatever rates the link
gives it meanwhile (a capacity change or other paths joining move the pong, as on the real link).

Paths ping at their own phases (a golden-ratio sequence of offsets, so they do not tick together),
and the planner reads the worst path (``services/planner/control.py`` takes the largest RTT and floor
over links). A path joins when bytes wait on it and leaves once its queues are empty, no ping is out
and its smoothed RTT is back within 1 % of the base (what the real link would then report, to that 1 %).

Liveness: the sender fails a connection whose pong is later than ``max(ping_timeout, stall_timeout)``
while its bytes did not move for as long, or later than ``LATE_PONG_CAP`` times that in any case
(``common/transfer/connection.py`` ``overdue``: the receiver's ``KV_PROGRESS`` and the kernel's
acknowledged bytes are its signs of movement, here the path's delivered bytes; the shorter
``ping_timeout`` applies only while bytes wait in the sender's own buffers, which the paths' buffers
keep empty here): :meth:`PathPings.tick` lists those connections in :attr:`PathPings.failed` as
``(path, connection)``, their ping lost with the connection, and the caller sends the chunks written
on them again (``SharedLink.resend``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from common.transfer.connection import LATE_PONG_CAP
from common.transfer.estimators import Ewma, WindowedMin, rtt_with_pings_out, worst_connection_floor
from services.router.bandwidth import water_fill

_GOLDEN = 0.6180339887498949


def send_shares(sends: Sequence[Sequence[float]], connections: int) -> list[float]:
    """Each connection's fraction of a transfer's bytes (``connections`` floats summing to 1), as
    ``KvLink`` places them: ``sends`` lists each ``send`` call's chunk sizes (bytes, >= 0, in order);
    every chunk goes to the connection with the fewest bytes of this send so far (ties to the first),
    and each send starts from empty queues (see the module docstring). All on the first connection
    when there are no bytes. Raises ``ValueError`` for ``connections`` < 1 or a negative chunk."""
    if connections < 1:
        raise ValueError(f"need connections >= 1, got {connections!r}")
    per = [0.0] * connections
    for chunks in sends:
        q = [0.0] * connections
        for c in chunks:
            if not c >= 0:
                raise ValueError(f"a chunk needs bytes >= 0, got {c!r}")
            k = q.index(min(q))
            q[k] += c
            per[k] += c
    total = sum(per)
    if total <= 0:
        return [1.0] + [0.0] * (connections - 1)
    return [x / total for x in per]


def transfer_shares(nbytes: float, fixed_bytes: float, token_chunks: int, fixed_chunks: int, connections: int,
                    pinned: float = 0.0) -> list[float]:
    """Each connection's fraction of a KV transfer of ``nbytes``: ``pinned`` (0..1) of it, produced before
    ``KV_ADMIT`` came back, follows ``KV_BEGIN`` on the first connection (``KvLink._conn_for``: a
    pipelined transfer's chunks stay behind it until admitted); the rest as :func:`send_shares` places
    it, its ``fixed_bytes`` (fixed-size state) and the per-token rest each as one layer's send of
    ``fixed_chunks`` / ``token_chunks`` equal chunks (0: one per connection; every layer's send splits
    alike, so one of each stands for all)."""
    fixed = min(fixed_bytes, nbytes)
    n = connections
    shares = send_shares([[part / k] * k for part, k in ((fixed, fixed_chunks or n), (nbytes - fixed, token_chunks or n))], n)
    if pinned > 0:
        shares = [pinned * (k == 0) + (1.0 - pinned) * x for k, x in enumerate(shares)]
    return shares


def connection_ahead(nbytes: float, shares: Sequence[float], conn_bytes: float = math.inf) -> list[float]:
    """Bytes a path holding ``nbytes`` (>= 0) in its buffers must deliver before a ping sent now on each
    of its connections is through: connection ``k`` holds ``B_k = nbytes * shares[k]``, none more than
    ``conn_bytes`` (the excess goes to the next connections with room, in order), and its ping waits
    until it sent its ``B_k`` while every other connection sent as much of its own, up to ``B_k`` (the
    link serves them in turn): ``sum_j min(B_j, B_k)``. 0 for an empty connection. One float per share."""
    return ahead_of(_capped([nbytes * s for s in shares], conn_bytes))


def ahead_of(held: Sequence[float]) -> list[float]:
    """Bytes to deliver before a ping entering each connection now is through, when connection ``k``
    holds ``held[k]`` bytes (>= 0) and the link serves the connections in turn:
    ``sum_j min(held[j], held[k])``; 0 for an empty connection."""
    return [sum(min(x, b) for x in held) if b > 0 else 0.0 for b in held]


def _capped(held: list[float], conn_bytes: float) -> list[float]:
    """``held`` (bytes per connection, changed in place and returned) with none above ``conn_bytes``:
    the excess goes to the next connections with room, in order, and what none has room for to the last."""
    spill = 0.0
    for k, b in enumerate(held):
        if b > conn_bytes:
            spill += b - conn_bytes
            held[k] = conn_bytes
    for k, b in enumerate(held):
        if spill <= 0:
            break
        room = min(spill, conn_bytes - b)
        if room > 0:
            held[k] += room
            spill -= room
    if spill > 0:
        held[-1] += spill
    return held


def drain_in_turn(held: list[float], nbytes: float) -> None:
    """Take ``nbytes`` (>= 0) out of connections holding ``held`` bytes (changed in place), serving them in
    turn: equal amounts from each connection that is not empty, the max-min fair split of
    :func:`services.router.bandwidth.water_fill` (so the emptiest runs dry first), at most what they hold
    in all."""
    taken = water_fill(nbytes, dict(enumerate(held)), {})
    for k, x in taken.items():
        held[k] = max(0.0, held[k] - x)


class ConnQueues:
    """Bytes each connection of each path holds in its buffers (socket and middlebox), kept from one tick
    to the next. The bytes a path took into its buffers since the last tick enter its connections by the
    transfer's shares (:func:`transfer_shares`; none above ``conn_bytes``), and the bytes it delivered
    leave them served in turn (:func:`drain_in_turn`: the link's token bucket meters every connection's
    writer piece by piece, ``common/lab/link_proxy.py``). So a connection given fewer of the bytes runs
    dry first, and a ping on it is through at once while the path's other connection is still loaded
    (its quick pongs lower that connection's floor, not the loaded one's). A ping on a connection that
    holds nothing any more is through by then. ``conn_bytes`` > 0: the most one connection holds
    (bytes)."""

    def __init__(self, conn_bytes: float = math.inf):
        self.conn_bytes = conn_bytes
        self.paths: dict[Hashable, tuple[list[float], float]] = {}  # key -> (bytes per connection, delivered then)

    def update(self, key: Hashable, nbytes: float, delivered: float, shares: Sequence[float]) -> list[float]:
        """Path ``key`` now holds ``nbytes`` (>= 0) in its buffers and has delivered ``delivered`` bytes in
        all (never decreasing); ``shares``: its head transfer's fraction per connection. Returns the bytes
        per connection (summing to ``nbytes``; the list is the state, do not change it)."""
        got = self.paths.get(key)
        if got is None:
            held = _capped([nbytes * s for s in shares], self.conn_bytes)
        else:
            held, was = got
            before = sum(held)
            gone = max(0.0, delivered - was)
            drain_in_turn(held, gone)
            entered = nbytes - before + gone
            if entered > 0:
                for k, s in enumerate(shares):
                    held[k] += entered * s
                _capped(held, self.conn_bytes)
            total = sum(held)
            if total > 0 and abs(total - nbytes) > 1e-9 * max(1.0, nbytes):  # rounding, or a resend: keep the split
                f = nbytes / total
                for k in range(len(held)):
                    held[k] *= f
        self.paths[key] = (held, delivered)
        return held

    def held(self, key: Hashable) -> list[float] | None:
        """Path ``key``'s bytes per connection at its last update (None when not tracked)."""
        got = self.paths.get(key)
        return None if got is None else got[0]

    def keep(self, keys: set[Hashable] | dict) -> None:
        """Forget every path not in ``keys`` (its buffers are empty)."""
        for key in [k for k in self.paths if k not in keys]:
            del self.paths[key]


class _Path:
    __slots__ = ("rtt", "floor", "next", "out", "seen", "moved")

    def __init__(self, first_at: float, floor_window_s: float, connections: int, now: float, progress: tuple[float, float]):
        self.rtt = Ewma(alpha=0.125)
        self.floor = [WindowedMin(floor_window_s) for _ in range(connections)]  # per connection
        self.next = first_at  # s: the next ping round
        self.out: list[tuple[float, float] | None] = [None] * connections  # per connection: (sent s, through at delivered bytes)
        self.seen = (now, *progress)  # the previous tick: (s, the path's delivered bytes, its rate in bytes/s)
        self.moved = (now, progress[0])  # (s, delivered bytes): when its delivered bytes last grew, while a ping was out


class PathPings:
    """See the module docstring. ``interval_s`` seconds between rounds (> 0), ``connections`` per path
    (>= 1), ``floor_window_s`` the floor's window (s), ``fail_after_s`` how late a pong fails its
    connection (s, > 0). :meth:`tick` at each report; raises ``ValueError`` for a bad setting."""

    def __init__(self, interval_s: float, connections: int, floor_window_s: float = 3.0, fail_after_s: float = float("inf")):
        if not interval_s > 0 or connections < 1 or not fail_after_s > 0:
            raise ValueError(f"need interval_s > 0, connections >= 1, fail_after_s > 0, got {interval_s!r}, {connections!r}, "
                             f"{fail_after_s!r}")
        self.interval_s, self.connections, self.floor_window_s = interval_s, connections, floor_window_s
        self.fail_after_s = fail_after_s
        self.failed: list[tuple[Hashable, int]] = []  # (path, connection) that failed at the latest tick
        self.paths: dict[Hashable, _Path] = {}
        self._joined = 0
        self._idle = (0.0,) * connections

    def tick(self, now: float, ahead: dict[Hashable, Sequence[float]], progress: Callable[[Hashable], tuple[float, float]],
             base_ms: float) -> tuple[float, float]:  # noqa: C901
        """Send the rounds that are due and fold in the pongs that are through, at ``now`` (s). ``ahead``:
        per path with bytes buffered, the bytes it must deliver before a ping entering each of its
        connections now is through (one float per connection, :func:`connection_ahead`; paths not
        named: none); ``progress(path)``: the bytes the path has delivered so far (never decreasing) and
        the rate it delivers at now (bytes/s). A pong is through once the path's delivered bytes reach
        its mark, at the time the previous tick's rate reaches it (the rates change only at events;
        within this tick at the latest), and reads that wait plus ``base_ms``. Returns the worst path's
        smoothed RTT and RTT floor (ms; ``base_ms`` when no path is probed)."""
        n = self.connections
        for key in ahead:
            if key not in self.paths:
                self._joined += 1
                p = self.paths[key] = _Path(now + (self._joined * _GOLDEN % 1.0) * self.interval_s, self.floor_window_s, n,
                                            now, progress(key))
                for f in p.floor:  # the real link pinged its idle connections all along: their last pongs, at the base
                    f.update(base_ms, now)
        worst_rtt, worst_floor, quiet = base_ms, base_ms, []
        self.failed = []
        idle = self._idle
        for key, p in self.paths.items():
            a = ahead.get(key, idle)
            outs = p.out
            due = now >= p.next
            last_round = -math.inf  # the latest round due by now, if one is
            if due:
                while p.next <= now:
                    p.next += self.interval_s
                last_round = p.next - self.interval_s
            pinging = any(outs)
            d_now = progress(key)[0] if pinging else 0.0
            if pinging and d_now > p.moved[1]:
                p.moved = (now, d_now)
            still = now - p.moved[0]  # seconds its bytes have not moved (while a ping was out)
            t0, d0, r0 = p.seen
            d_sent = None
            waiting: list[float | None] = [None] * n  # per connection: when its ping of an earlier round went out
            # the latest send time of the pings still out from earlier rounds; None once a connection has none
            youngest: float | None = -math.inf
            for c in range(n):
                o = outs[c]
                if o is not None:
                    # through: when the delivered bytes passed its mark, or by now if its connection holds
                    # nothing any more (the bytes it waited behind are delivered; the mark, set by the
                    # path's bytes served in turn, can lie beyond what the path carries before it idles)
                    if d_now >= o[1] or a[c] <= 0:
                        youngest = None
                        back = min(now, t0 + max(0.0, o[1] - d0) / r0) if r0 > 0 else now
                        sample = base_ms + 1e3 * max(0.0, back - o[0])
                        p.rtt.update(sample, now)
                        p.floor[c].update(sample, now)
                        outs[c] = None
                        if back > last_round:  # still out at the latest round: that round skipped it
                            continue
                    else:
                        late = now - o[0]
                        if late > self.fail_after_s and (still > self.fail_after_s or late > LATE_PONG_CAP * self.fail_after_s):
                            # its replacement pings at the next round
                            self.failed.append((key, c))
                            outs[c] = None
                            youngest = None  # redialled without a ping out
                        else:
                            waiting[c] = o[0]
                            if youngest is not None:
                                youngest = max(youngest, o[0])
                        continue
                youngest = None  # this connection has no ping out
                if not due:
                    continue
                if a[c] <= 0:  # nothing ahead of it: back at the base RTT
                    p.rtt.update(base_ms, now)
                    p.floor[c].update(base_ms, now)
                else:
                    if d_sent is None:
                        d_sent = progress(key)[0]
                        if not pinging:  # the first ping out: its bytes' clock starts now
                            p.moved = (now, d_sent)
                    outs[c] = (now, d_sent + a[c])
            p.seen = (now, *progress(key)) if any(outs) else (now, 0.0, 0.0)
            waited = None if youngest is None else base_ms + 1e3 * (now - youngest)
            rtt, _ = rtt_with_pings_out(p.rtt.value, None, waited)
            floor = worst_connection_floor((p.floor[c].value(now), None if waiting[c] is None else base_ms + 1e3 * (now - waiting[c]))
                                           for c in range(n))
            if rtt is not None:
                worst_rtt = max(worst_rtt, rtt)
            if floor is not None:
                worst_floor = max(worst_floor, floor)
            if max(a) <= 0 and not any(outs) and (rtt is None or rtt <= base_ms * 1.01):
                quiet.append(key)
        for key in quiet:
            del self.paths[key]
        return worst_rtt, worst_floor
