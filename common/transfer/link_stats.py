"""Per-link congestion signals for the multi-connection KV transfer engine.

A *link* is the set of N parallel TCP connections from this process to one peer (e.g. the PrfaaS
prefill cluster streaming KVCache to one PD-D decode worker). :class:`LinkStats` folds together what
the engine observes itself (bytes written, application ping/pong RTT, stalls, reconnects, queue depth)
and what the kernel knows per connection (``TCP_INFO``: smoothed RTT, retransmits, lost segments,
congestion window, bytes acked), and estimates the link's capacity passively from the rate at which
the kernel acknowledges bytes while the engine is backlogged (:meth:`LinkStats.capacity_bytes_per_s`,
over a :class:`~common.transfer.estimators.WindowedMax`). :meth:`LinkStats.snapshot` is a
msgpack/JSON-safe ``dict`` for the planner/router;
:func:`common.transfer.link_metrics.link_metric_families` turns snapshots into Prometheus metric
families.

Units: byte counts are bytes, durations given to methods are seconds (``float``, from a monotonic
clock, ``time.monotonic`` by default), rates in snapshots are bits per second (``*_bps``) and RTTs in
snapshots are milliseconds (``*_ms``). The kernel's view comes from :mod:`common.transfer.tcp_info`,
the averages from :mod:`common.transfer.estimators`.

Nothing here does I/O besides ``getsockopt``; no method blocks or awaits.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from common.transfer.estimators import Clock, Ewma, WindowedMax, WindowedMin, check_finite, rtt_with_pings_out, worst_connection_floor
from common.transfer.tcp_info import TcpInfo, as_socket, read_tcp_info

__all__ = ["LinkStats"]


def _sock_key(s: Any) -> tuple:
    """Identity of a connection for delta tracking: fd plus both endpoints (a reconnect that reuses
    the fd almost surely has a different local port)."""
    try:
        fd = s.fileno()
    except Exception:  # noqa: BLE001 - any socket-like object
        fd = id(s)
    try:
        local = s.getsockname()
    except Exception:  # noqa: BLE001
        local = None
    try:
        remote = s.getpeername()
    except Exception:  # noqa: BLE001
        remote = None
    return (fd, _hashable(local), _hashable(remote))


def _hashable(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_hashable(i) for i in x)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


@dataclass(slots=True)
class _ConnBase:
    total_retrans: int
    bytes_acked: int | None


TIME_SCALE_ENV = "PRFAAS_LINK_STATS_TIME_SCALE"


def windows_from_env(environ: dict[str, str] | None = None) -> dict[str, float]:
    """:class:`LinkStats` keyword arguments for a compressed clock: with ``$PRFAAS_LINK_STATS_TIME_SCALE``
    = k (the emulated cluster sets it to its ``time_scale``), the goodput half-life (5 s) and the
    capacity window (30 s) are divided by k, so that they span the same emulated seconds as on real
    hardware (a 30 s capacity window at k = 5 would otherwise hold a stale capacity for 150 emulated
    seconds after the link drops). The 1 s measurement window and the 3 s RTT-floor window are not
    scaled: they count samples (one-second intervals, pings), and fewer would make them noise; the
    capacity window never goes below the measurement window. Unset: ``{}`` (the defaults).
    Raises ValueError if the variable is not a positive finite number."""
    raw = (os.environ if environ is None else environ).get(TIME_SCALE_ENV)
    if not raw:
        return {}
    try:
        k = float(raw)
    except ValueError:
        k = math.nan
    if not (math.isfinite(k) and k > 0):
        raise ValueError(f"{TIME_SCALE_ENV} must be a positive finite number, got {raw!r}")
    return {"half_life_s": 5.0 / k, "capacity_window_s": max(1.0, 30.0 / k)}


class LinkStats:
    """Congestion signals for one peer link (N parallel TCP connections), aggregated.

    **Goodput** (``goodput_bps`` in the snapshot) is the EWMA (``half_life_s``) of per-window send
    rates, where a window is ``window_s`` seconds and its rate is the bytes reported through
    :meth:`on_bytes_sent` in that window divided by ``window_s``. The engine is expected to call
    :meth:`on_bytes_sent` once ``writer.drain()`` has returned for those bytes, i.e. for bytes
    *written and drained* into the kernel; since the kernel send buffer is bounded, this equals the
    delivered rate over windows long compared with ``SO_SNDBUF / rate``. Only complete windows count
    (the estimate lags by at most ``window_s``); windows with no bytes count as rate 0, so goodput
    decays while the link is idle. A second estimate from the kernel's ``bytes_acked`` counters,
    ``tcp_goodput_bps``, is updated by :meth:`sample_tcp` (rate between consecutive samples).

    **RTT**: ``rtt_ms`` is the per-sample EWMA (``rtt_alpha``, 1/8 as in RFC 6298) of application
    ping/pong RTTs given to :meth:`on_rtt`; ``tcp_srtt_ms`` / ``tcp_srtt_max_ms`` are the mean / max of
    the kernels' smoothed RTTs over the connections read by the latest :meth:`sample_tcp`.

    **Retransmits**: ``retransmits`` is the cumulative number of retransmitted segments over every
    connection seen by :meth:`sample_tcp` (a connection first seen contributes its whole history);
    ``retransmits_window`` is the increase since the previous :meth:`sample_tcp` call. Retransmits
    of a connection between its last sample and its close are not seen. Pass *all* of the link's
    current sockets to every :meth:`sample_tcp` call: a connection left out is forgotten, and counted
    again from zero if it comes back.

    **Capacity** (``capacity_bps``): a passive estimate of what the link can carry, for utilisation =
    goodput / capacity. A *capacity interval* is a run of consecutive :meth:`sample_tcp` intervals
    spanning at least ``window_s``; its rate is the bytes the kernel reports acknowledged
    (``TCP_INFO`` ``bytes_acked``, summed over the link's connections) over its length. It is a
    sample only if (1) the sender was backlogged all through it, i.e. the engine's queue
    (:attr:`bytes_queued`) never ran empty, (2) so was the interval before it (the first interval of a
    backlog run also fills the buffers past the sender's kernel, e.g. a TCP-terminating proxy's, and
    overstates the rate), and (3) the same connections, all with ``bytes_acked``, were read at every
    sample in it (a connection that opens or closes voids it). ``capacity_bps`` is the largest
    sample stamped in the last ``capacity_window_s`` seconds (default 30 s, about 30 one-second
    intervals), None when there is none. While the engine's queue is non-empty its writers keep the
    transport and kernel send buffers full, so TCP is limited by the path (congestion or receive
    window), not by the application: the acked rate is then what the path delivers to this link.
    Bytes *acked* are used rather than bytes drained (``goodput_bps``) because drains come in bursts
    (asyncio resumes a writer at its low-water mark, megabytes per connection at once): at a 50 Mbit/s
    cap one-second drain windows alternated between 0 and several times the cap. ``TCP_INFO``
    ``delivery_rate`` (when not ``delivery_rate_app_limited``) is not used either: it is one ACK's
    rate sample, and behind a TCP-terminating hop (the userspace link proxy, WAN optimisers) it showed
    bursts at loopback speed, tens of Gbit/s against a 50 Mbit/s cap, which a max filter keeps.
    Caveats: an idle or application-limited link gives no sample (neither does one that is not
    sampled, or has no ``TCP_INFO``, i.e. not Linux), and neither does a transfer that fits in the
    transport and kernel buffers below the engine; within the window the estimate only rises, so
    after the path's capacity drops the old value stays for up to ``capacity_window_s`` (the
    congestion signals show the drop meanwhile), and with no new sample it ages out to None after
    that long. It is what this link's connections can get: a send buffer smaller than the
    bandwidth-delay product, a slow receiver or competing traffic keeps it below the wire's rate,
    and several links backlogged at once through one bottleneck each measure their share.

    Times (``now``) are seconds from ``clock`` (``time.monotonic`` by default); every method that
    takes ``now`` reads the clock when it is None. Not thread-safe: use it from one event loop.
    """

    def __init__(self, peer: str = "", *, window_s: float = 1.0, half_life_s: float = 5.0,
                 rtt_alpha: float = 0.125, capacity_window_s: float = 30.0, rtt_floor_window_s: float = 3.0,
                 clock: Clock = time.monotonic) -> None:
        """Raises ValueError if ``window_s`` or ``half_life_s`` is not a positive finite number of
        seconds, ``capacity_window_s`` is not a finite number of seconds >= ``window_s``, or
        ``rtt_alpha`` is not in (0, 1], or ``rtt_floor_window_s`` is not a positive finite number of
        seconds."""
        w = float(window_s)
        if not (math.isfinite(w) and w > 0.0):
            raise ValueError(f"window_s must be a positive finite number of seconds, got {window_s!r}")
        cw = float(capacity_window_s)
        if not (math.isfinite(cw) and cw >= w):
            raise ValueError(f"capacity_window_s must be a finite number of seconds >= window_s ({w}), "
                             f"got {capacity_window_s!r}")
        self.peer = str(peer)
        self.window_s = w
        self.capacity_window_s = cw
        self._clock = clock
        # Link capacity (bytes/s), see the class docstring.
        self._capacity = WindowedMax(cw)
        self._tcp_backlogged = False  # the engine's queue was non-empty since the previous sample_tcp
        self._acc_start: float | None = None  # start (s) of the open bytes_acked interval
        self._acc_bytes = 0  # bytes acked in it, over the link's connections
        self._acc_valid = False  # backlogged all through it, and every connection's bytes known
        self._prev_acc_valid = False  # the same for the interval before it
        self._goodput = Ewma(half_life_s=half_life_s, clock=clock)  # bytes/s
        self._tcp_goodput = Ewma(half_life_s=half_life_s, clock=clock)  # bytes/s
        self._rtt = Ewma(rtt_alpha, clock=clock)  # seconds
        self._rtt_last_s: float | None = None
        self._rtt_min_s: float | None = None
        self._floor_window_s = check_finite("rtt_floor_window_s", rtt_floor_window_s)
        if not self._floor_window_s > 0.0:
            raise ValueError(f"rtt_floor_window_s must be a positive finite number of seconds, got {rtt_floor_window_s!r}")
        # per connection (its id; None for samples that name none): the lowest ping of the last few seconds
        self._conn_floor: dict[Any, WindowedMin] = {}
        self._conn_ping_out: dict[Any, float] = {}  # per connection: when its ping of an earlier round went out
        self._pings_out_since: float | None = None  # when the youngest ping went out, while every connection has one out
        self._win_start: float | None = None
        self._win_bytes = 0
        self._last_window_rate: float | None = None  # bytes/s of the latest complete window
        self.bytes_sent_total = 0
        self._bytes_queued = 0
        self._queued_since: float | None = None  # when the engine's queue last went from empty to non-empty
        self.connections = 0
        self.stalls = 0
        self.reconnects = 0
        self.stalls_by_conn: dict[Any, int] = {}
        self.reconnects_by_conn: dict[Any, int] = {}
        self.retransmits = 0
        self.retransmits_window = 0
        self._conn_base: dict[tuple, _ConnBase] = {}
        self._tcp_last_sample: float | None = None
        self._tcp_srtt_ms: float | None = None
        self._tcp_srtt_max_ms: float | None = None
        self._tcp_lost = 0
        self._tcp_snd_cwnd = 0
        self._tcp_unacked = 0
        self._tcp_notsent_bytes: int | None = None

    # -- engine events ----------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return check_finite("now", self._clock() if now is None else now)

    def _advance(self, now: float) -> None:
        """Close every window that ended at or before ``now``, folding its rate into the EWMA."""
        if self._win_start is None:
            self._win_start = now
            return
        end = self._win_start + self.window_s
        if now < end:
            return
        rate = self._win_bytes / self.window_s
        self._goodput.update(rate, end)
        self._last_window_rate = rate
        self._win_bytes = 0
        # Any further complete windows are empty: one zero-rate update spanning all of them is the
        # same as one per window for the time-aware EWMA.
        k = math.floor((now - end) / self.window_s)
        if k > 0:
            end += k * self.window_s
            self._goodput.update(0.0, end)
            self._last_window_rate = 0.0
        self._win_start = end

    def on_bytes_sent(self, n: int, now: float | None = None) -> None:
        """Count ``n`` bytes written and drained on any of the link's connections at ``now`` (s).

        Raises ValueError if ``n`` is negative or ``now`` not finite.
        """
        n = int(n)
        if n < 0:
            raise ValueError(f"bytes sent must be >= 0, got {n}")
        t = self._now(now)
        self._advance(t)
        self._win_bytes += n
        self.bytes_sent_total += n

    def on_rtt(self, seconds: float, now: float | None = None, conn: Any = None) -> None:
        """Fold in one application-level ping/pong round-trip time, in seconds, of connection ``conn``
        (any hashable id; None when the caller names none).

        Raises ValueError if ``seconds`` is negative or not finite.
        """
        s = check_finite("rtt", seconds)
        if s < 0.0:
            raise ValueError(f"rtt must be >= 0 seconds, got {seconds!r}")
        t = self._now(now)
        self._rtt.update(s, t)
        self._rtt_last_s = s
        self._rtt_min_s = s if self._rtt_min_s is None else min(self._rtt_min_s, s)
        floor = self._conn_floor.get(conn)
        if floor is None:
            floor = self._conn_floor[conn] = WindowedMin(self._floor_window_s)
        floor.update(s, t)
        self._conn_ping_out.pop(conn, None)
        self._pings_out_since = None  # a pong: not every connection waits any more (the next ping round says)

    def note_pings_out(self, youngest_sent: float | None, by_conn: dict[Any, float] | None = None) -> None:
        """The pings still awaiting a pong, before a new round goes out (this clock's seconds).
        ``youngest_sent``: when the youngest went out, given while every live connection has one out;
        None when some connection has none (the snapshot's ``rtt_ms`` then counts those pings as
        taking at least that long, ``rtt_with_pings_out``). ``by_conn``: connection id -> when its
        ping went out, for the connections with one out; None means ``{None: youngest_sent}`` (a
        caller that names no connections). A connection without a pong in the floor's window reads
        its waiting ping's age as its floor (see :meth:`rtt_floor`)."""
        self._pings_out_since = youngest_sent
        if by_conn is None:
            by_conn = {} if youngest_sent is None else {None: youngest_sent}
        self._conn_ping_out = dict(by_conn)

    def rtt_floor(self, now: float | None = None) -> float | None:
        """The path's standing queueing delay as the worst connection sees it (seconds; None without
        a sample or a ping out): per connection, the lowest RTT of its pongs in the last
        ``rtt_floor_window_s`` seconds (CoDel's test: a queue that never drained in that window), or,
        without one there, how long its ping still out has waited; the largest over the connections
        (:func:`~common.transfer.estimators.worst_connection_floor` says why not the lowest). In the
        emulated bandwidth swing the lowest read as a healthy link mid-way through a saturated phase.
        Connections with neither are forgotten here."""
        t = self._now(now)
        per_conn = []
        for key in set(self._conn_floor) | set(self._conn_ping_out):
            floor = self._conn_floor.get(key)
            v = None if floor is None else floor.value(t)
            sent = self._conn_ping_out.get(key)
            if v is None and sent is None:
                del self._conn_floor[key]  # aged out, nothing waiting: forget the connection
                continue
            per_conn.append((v, None if sent is None else max(0.0, t - sent)))
        return worst_connection_floor(per_conn)

    def on_stall(self, conn_id: Any) -> None:
        """Count one stall (a connection that made no progress within the engine's deadline)."""
        self.stalls += 1
        self.stalls_by_conn[conn_id] = self.stalls_by_conn.get(conn_id, 0) + 1

    def on_reconnect(self, conn_id: Any) -> None:
        """Count one reconnect of connection ``conn_id``."""
        self.reconnects += 1
        self.reconnects_by_conn[conn_id] = self.reconnects_by_conn.get(conn_id, 0) + 1

    @property
    def bytes_queued(self) -> int:
        """Bytes waiting in the engine's send queues for this link (set by the engine)."""
        return self._bytes_queued

    @bytes_queued.setter
    def bytes_queued(self, n: int) -> None:
        """Raises ValueError if ``n`` is negative.

        The engine must report every change, in particular each time the queue runs empty: a
        capacity interval in which the queue was ever empty is application-limited and gives no
        capacity sample (see the class docstring).
        """
        n = int(n)
        if n < 0:
            raise ValueError(f"bytes_queued must be >= 0, got {n}")
        self._bytes_queued = n
        if n == 0:
            self._tcp_backlogged = False
            self._queued_since = None
        elif self._queued_since is None:
            self._queued_since = self._clock()

    # -- kernel view ------------------------------------------------------------------------------

    def sample_tcp(self, socks: Iterable[Any] | Mapping[Any, Any], now: float | None = None) -> int:
        """Read ``TCP_INFO`` from each of the link's sockets (or asyncio transports) and fold it in.

        ``socks`` is an iterable of sockets/transports, or a mapping whose values are. Sockets that
        give no ``TCP_INFO`` (closed, not TCP, not Linux) are skipped. Updates ``connections`` (to
        the number read), the TCP SRTT mean/max, summed ``lost``/``snd_cwnd``/``unacked``, the
        retransmit counters and ``tcp_goodput_bps``. Returns the number of sockets read.
        """
        if isinstance(socks, Mapping):
            socks = socks.values()
        return self.fold_tcp([(s, read_tcp_info(s)) for s in socks], now)

    def fold_tcp(self, readings: Iterable[tuple[Any, TcpInfo | None]], now: float | None = None) -> int:
        """:meth:`sample_tcp` with the ``TCP_INFO`` already read: ``readings`` pairs each socket (or
        transport) with what :func:`read_tcp_info` gave for it (None: skipped), for a caller that
        also uses the readings itself. Returns the number of sockets folded in."""
        t = self._now(now)
        infos: list[tuple[tuple, TcpInfo]] = [(_sock_key(as_socket(s)), info) for s, info in readings if info is not None]

        delta_retrans = 0
        acked = 0
        acked_known = False
        # Every connection read now was read at the previous sample too, with bytes_acked both times.
        all_known = bool(infos) and {k for k, _ in infos} == set(self._conn_base)
        new_base: dict[tuple, _ConnBase] = {}
        for key, info in infos:
            old = self._conn_base.get(key)
            if old is None or info.total_retrans < old.total_retrans:
                delta_retrans += info.total_retrans  # new connection (or counter reset): whole history
            else:
                delta_retrans += info.total_retrans - old.total_retrans
            if info.bytes_acked is not None:
                if old is not None and old.bytes_acked is not None and info.bytes_acked >= old.bytes_acked:
                    acked += info.bytes_acked - old.bytes_acked
                    acked_known = True
                else:
                    # A connection seen for the first time only sets its baseline (its history may
                    # span far more than the interval).
                    all_known = False
            else:
                all_known = False
            new_base[key] = _ConnBase(info.total_retrans, info.bytes_acked)
        self._conn_base = new_base

        self.retransmits += delta_retrans
        self.retransmits_window = delta_retrans
        self.connections = len(infos)
        if infos:
            rtts = [i.rtt_us / 1000.0 for _, i in infos]
            self._tcp_srtt_ms = sum(rtts) / len(rtts)
            self._tcp_srtt_max_ms = max(rtts)
        else:
            self._tcp_srtt_ms = self._tcp_srtt_max_ms = None
        self._tcp_lost = sum(i.lost for _, i in infos)
        self._tcp_snd_cwnd = sum(i.snd_cwnd for _, i in infos)
        self._tcp_unacked = sum(i.unacked for _, i in infos)
        notsent = [i.notsent_bytes for _, i in infos if i.notsent_bytes is not None]
        self._tcp_notsent_bytes = sum(notsent) if notsent else None

        prev = self._tcp_last_sample
        if prev is not None and t > prev and (acked_known or not infos):
            self._tcp_goodput.update(acked / (t - prev), t)
        if prev is None or t > prev:
            self._capacity_interval(t, acked, self._tcp_backlogged and all_known)
            self._tcp_last_sample = t
            self._tcp_backlogged = self._bytes_queued > 0
        return len(infos)

    def _capacity_interval(self, now: float, acked: int, valid: bool) -> None:
        """Fold the sample_tcp interval ending at ``now`` (``acked`` bytes; ``valid``: backlogged all
        through it, every connection's bytes known) into the open capacity interval; close that once
        it spans ``window_s``, taking a sample if it and the interval before it were both valid."""
        if self._acc_start is None:  # the first sample only opens an interval
            self._acc_start, self._acc_bytes, self._acc_valid = now, 0, True
            return
        self._acc_bytes += acked
        self._acc_valid = self._acc_valid and valid
        span = now - self._acc_start
        if span < self.window_s:
            return
        if self._acc_valid and self._prev_acc_valid:
            self._capacity.update(self._acc_bytes / span, now)
        self._prev_acc_valid = self._acc_valid
        self._acc_start, self._acc_bytes, self._acc_valid = now, 0, True

    # -- outputs ----------------------------------------------------------------------------------

    @property
    def goodput_bps(self) -> float:
        """Goodput EWMA in bits per second (0.0 before the first complete window)."""
        v = self._goodput.value
        return 0.0 if v is None else v * 8.0

    @property
    def rtt_min_s(self) -> float | None:
        """The lowest application RTT seen on the link (s), None before a sample."""
        return self._rtt_min_s

    def capacity_bytes_per_s(self, now: float | None = None) -> float | None:
        """The link capacity estimate at ``now`` (s), bytes/s: the largest backlogged-interval rate
        of the last ``capacity_window_s`` seconds, or None if there is none (see the class
        docstring). Raises ValueError if ``now`` is not finite."""
        return self._capacity.value(self._now(now))

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """The link's signals as a flat dict of str/int/float/None (msgpack- and JSON-safe, finite).

        Closes windows that ended by ``now`` first, so an idle link's goodput decays. Keys:
        ``peer``, ``connections``, ``goodput_bps`` (bits/s, EWMA), ``goodput_window_bps`` (bits/s of
        the latest complete window, None before one), ``tcp_goodput_bps`` (bits/s from bytes acked,
        None before two samples), ``bytes_sent`` (bytes, cumulative), ``bytes_queued`` (bytes),
        ``rtt_ms`` / ``rtt_last_ms`` / ``rtt_min_ms`` (application RTT, ms, None before a sample),
        ``backlogged_s`` (seconds the engine's queue has stayed non-empty without a break, 0.0 when
        empty), ``rtt_floor_ms`` (ms, :meth:`rtt_floor`: the worst connection's lowest application RTT
        of the last ``rtt_floor_window_s``, None without a sample there or a ping out: a floor above
        ``rtt_min_ms`` is a queue that did not drain once in that window, where our own bursts of KV
        only raise the smoothed and the last RTT; ``rtt_ms`` counts the pings still out when every
        connection has one, :meth:`note_pings_out`),
        ``tcp_srtt_ms`` / ``tcp_srtt_max_ms`` (ms, None when no socket was read),
        ``tcp_lost`` / ``tcp_unacked`` / ``tcp_snd_cwnd`` (segments, summed over connections),
        ``tcp_notsent_bytes`` (bytes or None), ``retransmits`` (segments, cumulative),
        ``retransmits_window`` (segments, since the previous sample), ``stalls``, ``reconnects``,
        ``capacity_bps`` (bits/s, the link capacity estimate; None before a backlogged sample and
        once every sample is older than ``capacity_window_s``, see the class docstring).
        """
        t = self._now(now)
        self._advance(t)
        tcp_gp = self._tcp_goodput.value
        since = self._pings_out_since
        rtt, _ = rtt_with_pings_out(self._rtt.value, None, None if since is None else max(0.0, t - since))
        floor = self.rtt_floor(t)
        cap = self.capacity_bytes_per_s(t)
        return {
            "peer": self.peer,
            "connections": int(self.connections),
            "goodput_bps": float(self.goodput_bps),
            "goodput_window_bps": None if self._last_window_rate is None else self._last_window_rate * 8.0,
            "tcp_goodput_bps": None if tcp_gp is None else tcp_gp * 8.0,
            "bytes_sent": int(self.bytes_sent_total),
            "bytes_queued": int(self._bytes_queued),
            "backlogged_s": 0.0 if self._queued_since is None else max(0.0, t - self._queued_since),
            "rtt_ms": None if rtt is None else rtt * 1000.0,
            "rtt_last_ms": None if self._rtt_last_s is None else self._rtt_last_s * 1000.0,
            "rtt_min_ms": None if self._rtt_min_s is None else self._rtt_min_s * 1000.0,
            "rtt_floor_ms": None if floor is None else floor * 1000.0,
            "tcp_srtt_ms": self._tcp_srtt_ms,
            "tcp_srtt_max_ms": self._tcp_srtt_max_ms,
            "tcp_lost": int(self._tcp_lost),
            "tcp_unacked": int(self._tcp_unacked),
            "tcp_snd_cwnd": int(self._tcp_snd_cwnd),
            "tcp_notsent_bytes": self._tcp_notsent_bytes,
            "retransmits": int(self.retransmits),
            "retransmits_window": int(self.retransmits_window),
            "stalls": int(self.stalls),
            "reconnects": int(self.reconnects),
            "capacity_bps": None if cap is None else cap * 8.0,
        }
