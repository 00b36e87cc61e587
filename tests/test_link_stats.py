"""Tests for common.transfer.tcp_info (TCP_INFO parsing), estimators (Ewma, WindowedMax), link_stats
(LinkStats) and link_metrics (Prometheus families)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import struct
import sys
import time
from types import SimpleNamespace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.transfer import tcp_info
from common.transfer.estimators import Ewma, WindowedMax
from common.transfer.link_metrics import link_metric_families
from common.transfer.link_stats import LinkStats
from common.transfer.tcp_info import TCP_INFO_MIN_LEN, TcpInfo, TcpState, read_tcp_info

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO layout is Linux's")


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tcp_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    """(client, server-side accepted, listener) connected over loopback."""
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    cli = socket.create_connection(lst.getsockname(), timeout=5)
    srv, _ = lst.accept()
    srv.settimeout(5)
    return cli, srv, lst


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(1 << 20, n - len(buf)))
        assert chunk, "peer closed early"
        buf += chunk
    return bytes(buf)


# Independent description of ``struct tcp_info`` (Linux uapi linux/tcp.h) written as one native-order
# format string in declaration order, so an offset slip in the module's field table shows up.
_FULL_FMT = "=" + "8B" + "24I" + "4Q" + "6I" + "4Q" + "2I" + "2Q" + "4I"
_FULL_LEN = struct.calcsize(_FULL_FMT)


def tcp_info_bytes(**over: int) -> bytes:
    """A synthetic ``struct tcp_info`` (232 bytes) with distinct values in every field."""
    u8 = [1, 0, 0, 0, 0, 7, 0x97, 0x01]  # state ESTABLISHED, wscale snd=7 rcv=9 (LE), app_limited
    u32 = [
        201000, 40000, 1448, 536,  # rto ato snd_mss rcv_mss
        11, 12, 13, 14, 15,  # unacked sacked lost retrans fackets
        16, 17, 18, 19,  # last_* ms
        1500, 64000, 2500, 1250, 0x7FFFFFFF, 10, 1460,  # pmtu rcv_ssthresh rtt rttvar ssthresh cwnd advmss
        3, 777, 65483, over.get("total_retrans", 42),  # reordering rcv_rtt rcv_space total_retrans
    ]
    q1 = [10**9, 2**40, over.get("bytes_acked", 123456789), 987654321]
    u32b = [1001, 1002, 1003, 1004, 1005, 1006]
    q2 = [5 * 10**8, 2001, 2002, 2003]
    u32c = [3001, 3002]
    q3 = [4001, 4002]
    u32d = [5001, 5002, 5003, 5004]
    return struct.pack(_FULL_FMT, *u8, *u32, *q1, *u32b, *q2, *u32c, *q3, *u32d)


class FakeSock:
    """Socket-like object whose TCP_INFO answer the test controls."""

    def __init__(self, port: int, fd: int = 7, **fields: int) -> None:
        self.port, self.fd, self.fields = port, fd, fields
        self.closed = False

    def set(self, **fields: int) -> None:
        self.fields.update(fields)

    def fileno(self) -> int:
        return -1 if self.closed else self.fd

    def getsockname(self):
        return ("10.0.0.1", self.port)

    def getpeername(self):
        return ("10.0.0.2", 9000)

    def getsockopt(self, level, opt, buflen):
        assert (level, opt) == (socket.IPPROTO_TCP, 11)
        if self.closed:
            raise OSError(9, "Bad file descriptor")
        base = bytearray(tcp_info_bytes(**{k: v for k, v in self.fields.items()
                                           if k in ("total_retrans", "bytes_acked")}))
        if "rtt_us" in self.fields:
            struct.pack_into("=I", base, 8 + 4 * 15, self.fields["rtt_us"])
        if "lost" in self.fields:
            struct.pack_into("=I", base, 8 + 4 * 6, self.fields["lost"])
        if "snd_cwnd" in self.fields:
            struct.pack_into("=I", base, 8 + 4 * 18, self.fields["snd_cwnd"])
        return bytes(base[:buflen])


# ---------------------------------------------------------------------------------------------------
# TCP_INFO parsing
# ---------------------------------------------------------------------------------------------------


def test_tcp_info_layout_constants():
    assert TCP_INFO_MIN_LEN == 104
    assert _FULL_LEN == 232


def test_from_bytes_full_struct_every_field():
    info = TcpInfo.from_bytes(tcp_info_bytes())
    assert info.info_len == 232
    assert (info.state, info.ca_state, info.options) == (1, 0, 7)
    if sys.byteorder == "little":
        assert (info.snd_wscale, info.rcv_wscale) == (7, 9)
        assert info.delivery_rate_app_limited is True and info.fastopen_client_fail == 0
    assert (info.rto_us, info.ato_us, info.snd_mss, info.rcv_mss) == (201000, 40000, 1448, 536)
    assert (info.unacked, info.sacked, info.lost, info.retrans, info.fackets) == (11, 12, 13, 14, 15)
    assert (info.last_data_sent_ms, info.last_ack_sent_ms, info.last_data_recv_ms, info.last_ack_recv_ms) == (16, 17, 18, 19)
    assert (info.pmtu, info.rcv_ssthresh, info.rtt_us, info.rttvar_us) == (1500, 64000, 2500, 1250)
    assert (info.snd_ssthresh, info.snd_cwnd, info.advmss, info.reordering) == (0x7FFFFFFF, 10, 1460, 3)
    assert (info.rcv_rtt_us, info.rcv_space, info.total_retrans) == (777, 65483, 42)
    assert (info.pacing_rate_bytes_per_s, info.max_pacing_rate_bytes_per_s) == (10**9, 2**40)
    assert (info.bytes_acked, info.bytes_received) == (123456789, 987654321)
    assert (info.segs_out, info.segs_in, info.notsent_bytes, info.min_rtt_us) == (1001, 1002, 1003, 1004)
    assert (info.data_segs_in, info.data_segs_out) == (1005, 1006)
    assert info.delivery_rate_bytes_per_s == 5 * 10**8
    assert (info.busy_time_us, info.rwnd_limited_us, info.sndbuf_limited_us) == (2001, 2002, 2003)
    assert (info.delivered, info.delivered_ce, info.bytes_sent, info.bytes_retrans) == (3001, 3002, 4001, 4002)
    assert (info.dsack_dups, info.reord_seen, info.rcv_ooopack, info.snd_wnd) == (5001, 5002, 5003, 5004)
    assert info.rtt_s == pytest.approx(0.0025)
    assert info.tcp_state is TcpState.ESTABLISHED


def test_from_bytes_truncated_tails_are_none():
    full = tcp_info_bytes()
    base = TcpInfo.from_bytes(full[:104])
    assert base.total_retrans == 42 and base.info_len == 104
    assert base.pacing_rate_bytes_per_s is None and base.bytes_acked is None and base.snd_wnd is None
    mid = TcpInfo.from_bytes(full[:136])  # through bytes_received (Linux 4.1)
    assert mid.bytes_received == 987654321 and mid.segs_out is None
    part = TcpInfo.from_bytes(full[:139])  # a u32 cut in half is not parsed
    assert part.segs_out is None
    with pytest.raises(ValueError):
        TcpInfo.from_bytes(full[:103])


def test_tcp_info_is_frozen():
    info = TcpInfo.from_bytes(tcp_info_bytes())
    with pytest.raises(AttributeError):
        info.rtt_us = 1  # type: ignore[misc]


@linux_only
def test_read_tcp_info_real_loopback_pair():
    cli, srv, lst = tcp_pair()
    try:
        n = 1 << 20
        cli.sendall(b"x" * n)
        assert recv_exactly(srv, n) == b"x" * n
        srv.sendall(b"y")
        recv_exactly(cli, 1)
        deadline = time.monotonic() + 5
        while True:
            ci = read_tcp_info(cli)
            assert ci is not None
            if (ci.rtt_us > 0 and (ci.bytes_acked is None or ci.bytes_acked >= n)) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        si = read_tcp_info(srv)
        assert si is not None
        assert ci.state == TcpState.ESTABLISHED == 1 and si.state == 1
        assert ci.rtt_us > 0
        assert ci.total_retrans == 0 and si.total_retrans == 0
        assert ci.info_len >= TCP_INFO_MIN_LEN
        # Values only right if the offsets are: RTO is at least TCP_RTO_MIN (200 ms) and bounded.
        assert 200_000 <= ci.rto_us <= 120_000_000
        assert 0 < ci.snd_mss <= ci.pmtu and 0 < ci.advmss <= ci.pmtu
        assert 1 <= ci.snd_cwnd < 1_000_000
        assert ci.lost == 0 and ci.unacked == 0
        if ci.bytes_acked is not None:  # Linux >= 4.1
            assert n <= ci.bytes_acked <= n + 2
            assert n <= si.bytes_received <= n + 2
            assert si.bytes_acked is not None and 1 <= si.bytes_acked <= 3
        if ci.segs_out is not None:
            assert ci.segs_out >= 1 and si.segs_in >= ci.segs_out - 2
        if ci.min_rtt_us is not None:
            assert 0 < ci.min_rtt_us <= 1_000_000
        if ci.bytes_sent is not None:  # Linux >= 4.19
            assert n <= ci.bytes_sent <= n + 2 and ci.bytes_retrans == 0
    finally:
        for s in (cli, srv, lst):
            s.close()


@linux_only
def test_read_tcp_info_listening_socket_state():
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        info = read_tcp_info(lst)
        assert info is not None and info.state == TcpState.LISTEN == 10
    finally:
        lst.close()


def test_read_tcp_info_udp_socket_is_none():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        u.bind(("127.0.0.1", 0))
        assert read_tcp_info(u) is None
    finally:
        u.close()


def test_read_tcp_info_unix_socket_is_none():
    a, b = socket.socketpair()
    try:
        assert read_tcp_info(a) is None
    finally:
        a.close()
        b.close()


@linux_only
def test_read_tcp_info_closed_socket_is_none():
    cli, srv, lst = tcp_pair()
    assert read_tcp_info(cli) is not None
    cli.close()
    assert read_tcp_info(cli) is None
    srv.close()
    lst.close()


def test_read_tcp_info_none_and_junk():
    assert read_tcp_info(None) is None
    assert read_tcp_info(object()) is None


def test_read_tcp_info_not_linux(monkeypatch):
    s = FakeSock(port=1)
    assert read_tcp_info(s) is not None
    monkeypatch.setattr(tcp_info, "_IS_LINUX", False)
    assert read_tcp_info(s) is None


def test_read_tcp_info_short_answer_is_none():
    class Short(FakeSock):
        def getsockopt(self, level, opt, buflen):
            return tcp_info_bytes()[:100]

    assert read_tcp_info(Short(port=1)) is None


@linux_only
async def test_read_tcp_info_asyncio_transport():
    got = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        data = await reader.readexactly(4096)
        writer.write(data[:1])
        await writer.drain()
        got.set_result(writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"z" * 4096)
        await writer.drain()
        assert await reader.readexactly(1) == b"z"
        for obj in (writer.transport, writer):  # a transport, or anything with get_extra_info
            info = read_tcp_info(obj)
            assert info is not None and info.state == 1 and info.total_retrans == 0
        srv_writer = await got
        assert read_tcp_info(srv_writer.transport).state == 1
        srv_writer.close()
    finally:
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
    assert read_tcp_info(writer.transport) is None


# ---------------------------------------------------------------------------------------------------
# Ewma
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"alpha": 0.5, "half_life_s": 1.0}, {"alpha": 0.0}, {"alpha": 1.5},
                                {"alpha": -0.1}, {"half_life_s": 0.0}, {"half_life_s": -1.0},
                                {"half_life_s": math.inf}, {"half_life_s": math.nan}])
def test_ewma_bad_args(kw):
    with pytest.raises(ValueError):
        Ewma(**kw)


def test_ewma_half_life_step():
    e = Ewma(half_life_s=2.0)
    assert e.value is None
    assert e.update(0.0, now=10.0) == 0.0
    assert e.update(1.0, now=12.0) == pytest.approx(0.5, abs=1e-12)
    assert e.update(1.0, now=14.0) == pytest.approx(0.75, abs=1e-12)
    assert e.count == 3 and e.last_update == 14.0


@settings(max_examples=200, deadline=None)
@given(h=st.floats(0.01, 1000.0), parts=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=50),
       step=st.floats(-1e6, 1e6).filter(lambda x: abs(x) > 1e-3))
def test_ewma_half_life_property_any_sampling(h, parts, step):
    """However a step is sampled over one half-life, it reaches 50% of the step."""
    e = Ewma(half_life_s=h)
    e.update(0.0, now=0.0)
    total = sum(parts)
    t = 0.0
    for i, p in enumerate(parts):
        t = h if i == len(parts) - 1 else min(t + p / total * h, h)  # end exactly on h
        e.update(step, now=t)
    assert e.value == pytest.approx(0.5 * step, rel=1e-9, abs=1e-9)


def test_ewma_same_time_and_backwards():
    e = Ewma(half_life_s=1.0)
    e.update(5.0, now=1.0)
    assert e.update(100.0, now=1.0) == 5.0  # held for zero time
    with pytest.raises(ValueError):
        e.update(1.0, now=0.5)
    with pytest.raises(ValueError):
        e.update(math.nan, now=2.0)
    with pytest.raises(ValueError):
        e.update(math.inf, now=2.0)


def test_ewma_alpha_mode_ignores_time():
    e = Ewma(0.25)
    e.update(8.0, now=0.0)
    assert e.update(0.0, now=0.0) == pytest.approx(6.0)
    assert e.update(0.0, now=1e6) == pytest.approx(4.5)
    assert e.update(4.5, now=5.0) == pytest.approx(4.5)  # earlier time is fine in alpha mode
    e.reset()
    assert e.value is None and e.count == 0


def test_ewma_uses_clock_when_now_omitted():
    clk = FakeClock(0.0)
    e = Ewma(half_life_s=1.0, clock=clk)
    e.update(0.0)
    clk.t = 1.0
    assert e.update(10.0) == pytest.approx(5.0)


# ---------------------------------------------------------------------------------------------------
# LinkStats: goodput, rtt, events
# ---------------------------------------------------------------------------------------------------


def drive_constant_rate(ls: LinkStats, clk: FakeClock, rate: float, seconds: float, sizes: list[int]) -> None:
    """Send at ``rate`` bytes/s for ``seconds``: each chunk is reported when it has drained."""
    end = clk.t + seconds
    i = 0
    while clk.t < end:
        n = sizes[i % len(sizes)]
        i += 1
        clk.t += n / rate
        ls.on_bytes_sent(n, clk.t)


@pytest.mark.parametrize("rate", [1e5, 12.5e6, 3e9])
def test_goodput_converges_to_true_rate(rate):
    clk = FakeClock()
    ls = LinkStats("peer", window_s=0.5, half_life_s=2.0, clock=clk)
    sizes = [max(1, int(rate * f)) for f in (0.001, 0.013, 0.0007, 0.021, 0.004)]
    drive_constant_rate(ls, clk, rate, 30.0, sizes)
    snap = ls.snapshot(clk.t)
    assert snap["goodput_bps"] == pytest.approx(8 * rate, rel=0.05)  # bits/s
    assert snap["goodput_window_bps"] == pytest.approx(8 * rate, rel=0.15)
    assert snap["bytes_sent"] == ls.bytes_sent_total


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(1e3, 1e10), chunk_frac=st.floats(0.0005, 0.05))
def test_goodput_converges_property(rate, chunk_frac):
    clk = FakeClock()
    ls = LinkStats(window_s=1.0, half_life_s=3.0, clock=clk)
    drive_constant_rate(ls, clk, rate, 40.0, [max(1, int(rate * chunk_frac))])
    # Chunks are whole bytes, so the true rate is what was sent over the time it took.
    assert ls.snapshot(clk.t)["goodput_bps"] / 8 == pytest.approx(rate, rel=0.05)


def test_goodput_tracks_rate_change_and_idle_decay():
    clk = FakeClock()
    ls = LinkStats(window_s=1.0, half_life_s=2.0, clock=clk)
    drive_constant_rate(ls, clk, 1e6, 30.0, [10_000])
    assert ls.goodput_bps == pytest.approx(8e6, rel=0.05)
    drive_constant_rate(ls, clk, 4e6, 30.0, [10_000])
    assert ls.goodput_bps == pytest.approx(32e6, rel=0.05)
    # Idle: every empty window counts as 0, so after one half-life it is about half.
    before = ls.snapshot(clk.t)["goodput_bps"]
    clk.t += 2.0
    after = ls.snapshot()["goodput_bps"]
    assert after == pytest.approx(before / 2, rel=0.3)
    clk.t += 3600.0
    assert ls.snapshot()["goodput_bps"] < 1.0


def test_goodput_long_idle_gap_equals_per_window_zeros():
    clk = FakeClock(0.0)
    a = LinkStats(window_s=1.0, half_life_s=5.0, clock=clk)
    b = LinkStats(window_s=1.0, half_life_s=5.0, clock=clk)
    for ls in (a, b):
        ls.on_bytes_sent(1000, 0.0)
        ls.on_bytes_sent(1000, 0.5)
    for k in range(1, 101):  # b is asked every window, a only at the end
        b.snapshot(float(k) + 0.25)
    assert a.snapshot(100.25)["goodput_bps"] == pytest.approx(b.snapshot(100.25)["goodput_bps"], rel=1e-9)
    assert a.goodput_bps > 0


def test_goodput_first_window_not_counted_until_complete():
    clk = FakeClock(0.0)
    ls = LinkStats(window_s=1.0, half_life_s=1.0, clock=clk)
    ls.on_bytes_sent(500, 0.0)
    ls.on_bytes_sent(500, 0.9)
    assert ls.snapshot(0.95)["goodput_bps"] == 0.0
    assert ls.snapshot(0.95)["goodput_window_bps"] is None
    assert ls.snapshot(1.0)["goodput_bps"] == pytest.approx(8000.0)


def test_on_bytes_sent_rejects_negative():
    ls = LinkStats(clock=FakeClock())
    with pytest.raises(ValueError):
        ls.on_bytes_sent(-1)
    with pytest.raises(ValueError):
        ls.on_bytes_sent(1, now=math.nan)


@pytest.mark.parametrize("kw", [{"window_s": 0}, {"window_s": -1}, {"window_s": math.inf},
                                {"half_life_s": 0}, {"rtt_alpha": 0}, {"rtt_alpha": 2},
                                {"capacity_window_s": 0.5}, {"capacity_window_s": math.inf},
                                {"capacity_window_s": math.nan}])
def test_linkstats_bad_args(kw):
    with pytest.raises(ValueError):
        LinkStats(**kw)


def test_rtt_ewma_and_events():
    clk = FakeClock()
    ls = LinkStats("decode-0", rtt_alpha=0.5, clock=clk)
    assert ls.snapshot()["rtt_ms"] is None
    ls.on_rtt(0.010)
    ls.on_rtt(0.030)
    ls.on_rtt(0.002)
    snap = ls.snapshot()
    assert snap["rtt_ms"] == pytest.approx(11.0)  # 10 -> 20 -> 11
    assert snap["rtt_last_ms"] == pytest.approx(2.0) and snap["rtt_min_ms"] == pytest.approx(2.0)
    assert snap["rtt_floor_ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        ls.on_rtt(-0.001)
    with pytest.raises(ValueError):
        ls.on_rtt(math.inf)
    ls.on_stall(0)
    ls.on_stall(0)
    ls.on_stall(3)
    ls.on_reconnect(3)
    ls.bytes_queued = 1 << 30
    with pytest.raises(ValueError):
        ls.bytes_queued = -5
    snap = ls.snapshot()
    assert (snap["stalls"], snap["reconnects"], snap["bytes_queued"]) == (3, 1, 1 << 30)
    assert ls.stalls_by_conn == {0: 2, 3: 1} and ls.reconnects_by_conn == {3: 1}
    assert snap["peer"] == "decode-0"


# ---------------------------------------------------------------------------------------------------
# LinkStats: TCP sampling
# ---------------------------------------------------------------------------------------------------


def test_sample_tcp_retransmit_deltas_and_aggregates():
    clk = FakeClock(0.0)
    ls = LinkStats(clock=clk)
    a = FakeSock(port=40001, fd=5, total_retrans=3, bytes_acked=1000, rtt_us=2000, lost=1, snd_cwnd=10)
    assert ls.sample_tcp([a]) == 1
    s = ls.snapshot()
    assert (s["retransmits"], s["retransmits_window"], s["connections"]) == (3, 3, 1)
    assert s["tcp_goodput_bps"] is None  # one sample: no interval yet

    clk.t = 0.5
    a.set(total_retrans=5, bytes_acked=501_000)
    b = FakeSock(port=40002, fd=6, total_retrans=2, bytes_acked=10**9, rtt_us=6000, lost=0, snd_cwnd=30)
    assert ls.sample_tcp({"c0": a, "c1": b}) == 2
    s = ls.snapshot()
    assert (s["retransmits"], s["retransmits_window"], s["connections"]) == (7, 4, 2)
    assert s["tcp_srtt_ms"] == pytest.approx(4.0) and s["tcp_srtt_max_ms"] == pytest.approx(6.0)
    assert (s["tcp_lost"], s["tcp_snd_cwnd"]) == (1, 40)
    assert s["tcp_goodput_bps"] == pytest.approx(8e6)  # a: 5e5 bytes acked in 0.5 s; b is new

    # No change: the window delta drops to zero, the total stays.
    clk.t = 2.0
    ls.sample_tcp([a, b])
    s = ls.snapshot()
    assert (s["retransmits"], s["retransmits_window"]) == (7, 0)

    # a reconnects on the same fd, new local port: its counters restart and all of them are new.
    clk.t = 3.0
    a2 = FakeSock(port=40003, fd=5, total_retrans=1, bytes_acked=10)
    b.set(total_retrans=4)
    ls.sample_tcp([a2, b])
    s = ls.snapshot()
    assert (s["retransmits"], s["retransmits_window"]) == (10, 3)

    # A counter that goes down under the same key is a new connection too (never a negative delta).
    clk.t = 4.0
    b.set(total_retrans=1)
    ls.sample_tcp([a2, b])
    s = ls.snapshot()
    assert (s["retransmits"], s["retransmits_window"]) == (11, 1)

    # Closed sockets are skipped.
    clk.t = 5.0
    a2.closed = True
    assert ls.sample_tcp([a2, b]) == 1
    assert ls.snapshot()["connections"] == 1


def test_sample_tcp_nothing_readable():
    clk = FakeClock(0.0)
    ls = LinkStats(clock=clk)
    assert ls.sample_tcp([]) == 0
    s = ls.snapshot()
    assert s["connections"] == 0 and s["tcp_srtt_ms"] is None and s["retransmits"] == 0


@linux_only
def test_sample_tcp_real_loopback_connections():
    pairs = [tcp_pair() for _ in range(3)]
    try:
        for cli, srv, _ in pairs:
            cli.sendall(b"k" * 65536)
            recv_exactly(srv, 65536)
        time.sleep(0.05)
        ls = LinkStats("loop")
        assert ls.sample_tcp([c for c, _, _ in pairs]) == 3
        s = ls.snapshot()
        assert s["connections"] == 3
        assert s["retransmits"] == 0 and s["retransmits_window"] == 0
        assert s["tcp_srtt_ms"] is not None and 0 < s["tcp_srtt_ms"] < 1000
        assert s["tcp_srtt_max_ms"] >= s["tcp_srtt_ms"]
        assert s["tcp_snd_cwnd"] >= 3
        for cli, srv, _ in pairs:
            cli.sendall(b"k" * 65536)
            recv_exactly(srv, 65536)
        time.sleep(0.05)
        ls.sample_tcp([c for c, _, _ in pairs])
        tg = ls.snapshot()["tcp_goodput_bps"]
        assert tg is not None and tg > 0
    finally:
        for trio in pairs:
            for sk in trio:
                sk.close()


# ---------------------------------------------------------------------------------------------------
# LinkStats: capacity estimate
# ---------------------------------------------------------------------------------------------------


def test_windowed_max_keeps_the_largest_recent_sample():
    m = WindowedMax(10.0)
    assert m.value(0.0) is None
    m.update(5.0, 0.0)
    m.update(3.0, 1.0)
    m.update(4.0, 2.0)
    assert m.value(2.0) == 5.0
    assert m.value(9.99) == 5.0
    assert m.value(10.0) == 4.0  # 5.0 aged out; 3.0 was dominated by the later, larger 4.0
    m.update(9.0, 11.0)
    assert m.value(11.0) == 9.0
    assert m.value(20.99) == 9.0 and m.value(21.0) is None
    m.update(1.0, 5.0)  # stamped before the previous sample: taken as stamped at 11.0
    assert m.value(21.0) is None  # (21 - 11 >= 10)
    m.update(2.0, 30.0)
    m.reset()
    assert m.value(30.0) is None
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            WindowedMax(bad)
    with pytest.raises(ValueError):
        WindowedMax(1.0).update(math.nan, 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(-1e6, 1e6)), min_size=1, max_size=40),
       st.floats(0.1, 20.0))
def test_windowed_max_matches_brute_force(steps, window):
    m, t, seen = WindowedMax(window), 0.0, []
    for dt, v in steps:
        t += dt
        m.update(v, t)
        seen.append((t, v))
        live = [x for ts, x in seen if t - ts < window]
        assert m.value(t) == max(live)


class AckedLink:
    """A link of ``n`` fake connections whose kernels acknowledge bytes at a rate the test sets; the
    engine samples TCP_INFO every ``step`` seconds, as KvLink's ping loop does."""

    def __init__(self, ls: LinkStats, clk: FakeClock, n: int = 4, step: float = 0.25) -> None:
        self.ls, self.clk, self.step = ls, clk, step
        self.socks = [FakeSock(port=41000 + i, fd=20 + i, total_retrans=0, bytes_acked=0) for i in range(n)]
        self.acked = [0.0] * n
        ls.sample_tcp(self.socks)  # the baseline

    def run(self, rate: float, seconds: float, between=None) -> None:
        """Acknowledge ``rate`` bytes/s (split over the connections) for ``seconds``, sampling each
        step; ``between()`` runs before each sample (e.g. to empty the engine's queue)."""
        for _ in range(round(seconds / self.step)):
            self.clk.t += self.step
            for i, s in enumerate(self.socks):
                self.acked[i] += rate * self.step / len(self.socks)
                s.set(bytes_acked=int(self.acked[i]))
            if between is not None:
                between()
            self.ls.sample_tcp(self.socks)


def test_capacity_from_backlogged_intervals():
    clk = FakeClock(0.0)
    ls = LinkStats(window_s=1.0, capacity_window_s=30.0, clock=clk)
    ls.bytes_queued = 8 << 20  # a backlog from the first TCP sample on
    link = AckedLink(ls, clk)
    assert ls.snapshot()["capacity_bps"] is None
    # The first backlogged second also fills the buffers past the sender (10x the rate): skipped.
    link.run(12.5e6, 1.0)
    assert ls.snapshot()["capacity_bps"] is None
    link.run(1.25e6, 1.0)
    assert ls.snapshot()["capacity_bps"] == pytest.approx(10e6)  # bits/s: 1.25 MB/s
    link.run(1.25e6, 3.0)
    assert ls.capacity_bytes_per_s() == pytest.approx(1.25e6)
    # More capacity shows at once (a max filter); goodput is independent of it.
    link.run(2.5e6, 2.0)
    snap = ls.snapshot()
    assert snap["capacity_bps"] == pytest.approx(20e6)
    assert snap["goodput_bps"] == 0.0  # nothing reported through on_bytes_sent
    assert type(snap["capacity_bps"]) is float and msgpack.unpackb(msgpack.packb(snap), raw=False) == snap
    types, samples = parse_exposition(expose("x", [({"peer": "p"}, ls)]))
    assert types["x_capacity_bits_per_second"][0] == "gauge"
    assert samples[("x_capacity_bits_per_second", frozenset({("peer", "p")}))] == ls.snapshot()["capacity_bps"]


def test_capacity_ignores_app_limited_intervals():
    clk = FakeClock(0.0)
    ls = LinkStats(window_s=1.0, clock=clk)
    link = AckedLink(ls, clk)
    # Never backlogged: the kernel acks whatever the engine writes, the engine is the limit.
    link.run(1e6, 5.0)
    assert ls.snapshot()["capacity_bps"] is None

    # Backlogged, except that the queue runs empty once a second: every interval is app-limited.
    def empty_once_a_second():
        if clk.t % 1.0 == 0.5:
            ls.bytes_queued = 0
            ls.bytes_queued = 1 << 20
    ls.bytes_queued = 1 << 20
    link.run(1e6, 6.0, between=empty_once_a_second)
    assert ls.snapshot()["capacity_bps"] is None
    # Backlogged throughout: the second full interval gives the first sample.
    link.run(1e6, 1.0)
    assert ls.snapshot()["capacity_bps"] is None
    link.run(1e6, 1.0)
    assert ls.snapshot()["capacity_bps"] == pytest.approx(8e6)


def test_capacity_voided_by_a_new_or_closed_connection():
    clk = FakeClock(0.0)
    ls = LinkStats(window_s=1.0, clock=clk)
    link = AckedLink(ls, clk, n=2)
    ls.bytes_queued = 1 << 20
    link.run(1e6, 1.0)
    # A reconnect: the new connection's earlier bytes are unknown, so this interval is void, and
    # the one after it is its successor's "first" interval.
    link.socks.append(FakeSock(port=42000, fd=30, total_retrans=0, bytes_acked=5 << 30))
    link.acked.append(float(5 << 30))
    link.run(1e6, 2.0)
    assert ls.snapshot()["capacity_bps"] is None
    link.run(1e6, 1.0)
    assert ls.snapshot()["capacity_bps"] == pytest.approx(8e6)
    # A connection that closes voids its interval too (its last bytes are lost).
    fresh = LinkStats(window_s=1.0, clock=clk)
    link2 = AckedLink(fresh, clk, n=3)
    fresh.bytes_queued = 1 << 20
    link2.run(1e6, 1.5)
    link2.socks[0].closed = True
    link2.run(4e6, 1.5)
    assert fresh.snapshot()["capacity_bps"] is None


def test_capacity_only_rises_within_the_window_then_ages_out():
    clk = FakeClock(0.0)
    ls = LinkStats(window_s=1.0, capacity_window_s=10.0, clock=clk)
    link = AckedLink(ls, clk)
    ls.bytes_queued = 1 << 20
    link.run(5e6, 3.0)
    t_high = clk.t  # the last 5 MB/s sample is stamped here
    assert ls.capacity_bytes_per_s() == pytest.approx(5e6)
    link.run(1e6, 5.0)  # the path slows: the estimate holds the old maximum within the window
    assert ls.capacity_bytes_per_s() == pytest.approx(5e6)
    clk.t = t_high + 10.0 - 1e-6
    assert ls.capacity_bytes_per_s() == pytest.approx(5e6)
    clk.t = t_high + 10.0  # the high sample ages out; the slower ones are still in the window
    assert ls.capacity_bytes_per_s() == pytest.approx(1e6)
    ls.bytes_queued = 0  # idle from here on: no new samples
    link.run(0.0, 12.0)
    snap = ls.snapshot()
    assert snap["capacity_bps"] is None
    assert "x_capacity_bits_per_second" not in parse_exposition(expose("x", [({}, ls)]))[0]


@linux_only
@pytest.mark.timeout(30)
async def test_capacity_of_a_rate_capped_loopback_link(monkeypatch):
    """A real KvLink (4 connections) to a real KvReceiver through a LinkProxy capped at 50 Mbit/s:
    an app-limited trickle gives no estimate; a backlogged bulk transfer gives one within 25% of the
    cap (not the loopback speed, hundreds of times more)."""
    import torch

    import common.transfer.connection as kv_connection
    from common.kv.layout import dtype_name, make_layout
    from common.lab.link_proxy import LinkProxy
    from common.transfer.ranges import tensor_ranges
    from common.transfer.receiver import KvReceiver
    from common.transfer.sender import KvLink

    cap_bps = 50e6
    # Buffers sized for this slow link (the engine's defaults hold ~48 MiB, 8 s at this rate; pings
    # queued behind them would time out): every hop holds a few hundred KiB per connection.
    monkeypatch.setattr(kv_connection, "SEND_BUFFER_BYTES", 256 << 10)
    monkeypatch.setattr(kv_connection, "WRITE_HIGH_WATER_BYTES", 256 << 10)
    fp = {"model": "capacity-test"}
    n_layers = 48
    rx = KvReceiver("rx", fp, n_layers)
    port = await rx.start("127.0.0.1", 0)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, rate_bps=cap_bps, max_buffer_bytes=256 << 10)
    pport = await proxy.start()
    # Connections the proxy accepts inherit this receive buffer (else the kernel grows it to tens of
    # MiB, acknowledging bytes long before they pass the cap).
    proxy._server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
    link = KvLink(f"127.0.0.1:{pport}", name="tx", fingerprint=fp, connections=4, chunk_bytes=64 << 10,
                  ping_interval=0.25, ping_timeout=5.0, stall_timeout=5.0)
    sender: asyncio.Task | None = None
    try:
        def layer(nbytes: int):
            t = torch.zeros(nbytes // 4, dtype=torch.float32)
            return t, make_layout([("k", dtype_name(t.dtype), list(t.shape))])

        # 1. App-limited, for ~3 s: a 128 KiB layer every 0.06 s, about 17 Mbit/s; the engine's
        # queue keeps running empty.
        small, lay_s = layer(128 << 10)
        rx.expect("trickle", lay_s["total"] * n_layers)
        tr = await link.begin("trickle", [lay_s] * n_layers, prompt_len=1)
        for i in range(n_layers):
            await link.send(tr, i, list(tensor_ranges(lay_s, "k", small)))
            await asyncio.sleep(0.06)
        await link.finish(tr, {"first_token": 1, "prompt_len": 1}, timeout=10)
        assert rx.release("trickle")
        snap = link.stats.snapshot()
        assert snap["goodput_bps"] > 1e6 and snap["connections"] == 4
        assert snap["capacity_bps"] is None, snap

        # 2. Backlogged: 72 MiB offered at once (12 s at the cap); measured, then aborted.
        big, lay_b = layer(3 << 19)
        rx.expect("bulk", lay_b["total"] * n_layers)
        tr = await link.begin("bulk", [lay_b] * n_layers, prompt_len=1)

        async def send_all():
            for i in range(n_layers):
                await link.send(tr, i, list(tensor_ranges(lay_b, "k", big)))

        sender = asyncio.create_task(send_all())
        deadline = time.monotonic() + 8.0
        while link.stats.snapshot()["capacity_bps"] is None:
            assert time.monotonic() < deadline, "no capacity estimate from a backlogged link"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        cap = link.stats.snapshot()["capacity_bps"]
        assert link.stats.bytes_queued > 0  # still backlogged
        assert cap == pytest.approx(cap_bps, rel=0.25), f"estimate {cap / 1e6:.1f} Mbit/s vs cap 50"
        link.abort(tr, "capacity measured")
        rx.release("bulk")
    finally:
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        await link.close()
        await proxy.close()
        await rx.close()


# ---------------------------------------------------------------------------------------------------
# snapshot and Prometheus
# ---------------------------------------------------------------------------------------------------

EXPECTED_KEYS = {
    "peer", "connections", "goodput_bps", "goodput_window_bps", "tcp_goodput_bps", "bytes_sent",
    "bytes_queued", "backlogged_s", "rtt_ms", "rtt_last_ms", "rtt_min_ms", "rtt_floor_ms", "tcp_srtt_ms", "tcp_srtt_max_ms", "tcp_lost",
    "tcp_unacked", "tcp_snd_cwnd", "tcp_notsent_bytes", "retransmits", "retransmits_window", "stalls",
    "reconnects", "capacity_bps",
}


def busy_link() -> tuple[LinkStats, FakeClock]:
    clk = FakeClock(0.0)
    ls = LinkStats("prefill-remote:7001", clock=clk)
    drive_constant_rate(ls, clk, 5e6, 10.0, [65536])
    ls.on_rtt(0.0123)
    ls.on_stall(1)
    ls.on_reconnect(1)
    ls.bytes_queued = 4096
    socks = [FakeSock(port=1, fd=3, total_retrans=2, bytes_acked=0), FakeSock(port=2, fd=4, total_retrans=0, bytes_acked=0)]
    ls.sample_tcp(socks)
    clk.t += 1
    socks[0].set(bytes_acked=10**6)
    ls.sample_tcp(socks)
    return ls, clk


def test_snapshot_is_msgpack_and_json_safe():
    for ls in (LinkStats(clock=FakeClock()), busy_link()[0]):
        snap = ls.snapshot()
        assert set(snap) == EXPECTED_KEYS
        for k, v in snap.items():
            assert v is None or type(v) in (int, float, str), (k, type(v))
            if isinstance(v, float):
                assert math.isfinite(v), k
        assert msgpack.unpackb(msgpack.packb(snap), raw=False) == snap
        assert json.loads(json.dumps(snap, allow_nan=False)) == snap


def expose(prefix: str, links) -> str:
    """What a /metrics page shows for ``links``: the families rendered by prometheus_client."""
    families = link_metric_families(prefix, links)
    return generate_latest(SimpleNamespace(collect=lambda: families)).decode()


def parse_exposition(text: str) -> tuple[dict[str, tuple[str, str]], dict[tuple[str, frozenset], float]]:
    """Parse exposition text with prometheus_client's parser: ({sample name: (type, help)},
    {(sample name, frozenset(labels)): value}); asserts one family per name and no repeated sample."""
    types: dict[str, tuple[str, str]] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert types.setdefault(s.name, (fam.type, fam.documentation)) == (fam.type, fam.documentation)
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    assert text.count("# TYPE ") == len({name for name in types}), "one TYPE line per family"
    return types, samples


def test_link_metric_families_match_snapshot():
    ls, clk = busy_link()
    labels = {"peer": 'dc-b "east"\\rack\n7', "role": "prefill"}
    snap = ls.snapshot()
    text = expose("prfaas_link", [(labels, ls)])
    types, samples = parse_exposition(text)
    lab = frozenset(labels.items())  # escaped on output, unescaped back by the parser
    assert samples == {
        ("prfaas_link_connections", lab): 2.0,
        ("prfaas_link_goodput_bits_per_second", lab): snap["goodput_bps"],
        ("prfaas_link_tcp_goodput_bits_per_second", lab): 8e6,
        ("prfaas_link_bytes_sent_total", lab): float(snap["bytes_sent"]),
        ("prfaas_link_bytes_queued", lab): 4096.0,
        ("prfaas_link_backlogged_seconds", lab): snap["backlogged_s"],
        ("prfaas_link_rtt_seconds", lab): snap["rtt_ms"] * 1e-3,
        ("prfaas_link_rtt_min_seconds", lab): snap["rtt_min_ms"] * 1e-3,
        ("prfaas_link_rtt_floor_seconds", lab): snap["rtt_floor_ms"] * 1e-3,
        ("prfaas_link_tcp_srtt_seconds", lab): snap["tcp_srtt_ms"] * 1e-3,
        ("prfaas_link_tcp_srtt_max_seconds", lab): snap["tcp_srtt_max_ms"] * 1e-3,
        ("prfaas_link_tcp_lost_segments", lab): float(snap["tcp_lost"]),
        ("prfaas_link_tcp_unacked_segments", lab): float(snap["tcp_unacked"]),
        ("prfaas_link_tcp_snd_cwnd_segments", lab): float(snap["tcp_snd_cwnd"]),
        ("prfaas_link_tcp_notsent_bytes", lab): float(snap["tcp_notsent_bytes"]),
        ("prfaas_link_retransmits_total", lab): 2.0,
        ("prfaas_link_retransmits_window", lab): 0.0,
        ("prfaas_link_stalls_total", lab): 1.0,
        ("prfaas_link_reconnects_total", lab): 1.0,
    }
    assert snap["capacity_bps"] is None  # no capacity sample yet: no family
    assert snap["tcp_srtt_ms"] == 2.5 and snap["bytes_sent"] > 0 and snap["tcp_snd_cwnd"] > 0
    for name, (mtype, _) in types.items():
        assert (mtype == "counter") == name.endswith("_total"), name
    assert types["prfaas_link_retransmits_total"] == ("counter", "Retransmitted TCP segments.")
    assert types["prfaas_link_rtt_seconds"] == ("gauge", "Application ping/pong RTT EWMA, seconds.")
    # The escaped form is on the wire, and counters keep their _total name on the TYPE line.
    assert 'peer="dc-b \\"east\\"\\\\rack\\n7"' in text
    assert "# TYPE prfaas_link_retransmits_total counter\n" in text


def test_link_metric_families_no_labels_and_missing_values_skipped():
    types, samples = parse_exposition(expose("x", [({}, LinkStats(clock=FakeClock()))]))
    assert samples[("x_stalls_total", frozenset())] == 0.0
    assert "x_rtt_seconds" not in types  # no RTT sample yet: no family at all
    assert link_metric_families("x", []) == []


def test_link_metric_families_many_links_one_type_each():
    a, _ = busy_link()
    b = LinkStats("other", clock=FakeClock())
    types, samples = parse_exposition(expose("prfaas_link", [({"peer": "a"}, a), ({"peer": "b"}, b.snapshot())]))
    assert samples[("prfaas_link_stalls_total", frozenset({("peer", "a")}))] == 1.0
    assert samples[("prfaas_link_stalls_total", frozenset({("peer", "b")}))] == 0.0
    assert ("prfaas_link_rtt_seconds", frozenset({("peer", "b")})) not in samples
    with pytest.raises(ValueError, match="duplicate label set"):
        link_metric_families("p", [({"peer": "a"}, a), ({"peer": "a"}, b)])


@pytest.mark.parametrize("prefix,labels", [("1bad", {}), ("has-dash", {}), ("", {}), ("ok", {"bad-name": 1}),
                                           ("ok", {"__reserved": 1}), ("ok", {"0x": 1}), ("ok", {"a:b": 1})])
def test_link_metric_families_reject_bad_names(prefix, labels):
    with pytest.raises(ValueError, match="invalid Prometheus|reserved"):
        link_metric_families(prefix, [(labels, LinkStats(clock=FakeClock()))])


def test_rtt_floor_tells_a_standing_queue_from_bursts():
    """The floor is the lowest ping of the last ``rtt_floor_window_s``: bursts (high pings with a low
    one among them) keep it at the base RTT; a queue that never drains lifts it."""
    clk = FakeClock()
    ls = LinkStats("decode-0", rtt_floor_window_s=3.0, clock=clk)
    for rtt in (0.001, 0.200, 0.150, 0.001, 0.300):  # our own KV bursts, one ping a second
        ls.on_rtt(rtt)
        clk.t += 1.0
    snap = ls.snapshot()
    assert snap["rtt_floor_ms"] == pytest.approx(1.0) and snap["rtt_ms"] > 50.0
    for rtt in (0.200, 0.250, 0.300, 0.350):  # the link shrank: every ping queues
        ls.on_rtt(rtt)
        clk.t += 1.0
    assert ls.snapshot()["rtt_floor_ms"] == pytest.approx(300.0)  # pings of the last 3 s: 300, 350
    clk.t += 5.0
    assert ls.snapshot()["rtt_floor_ms"] is None  # no ping in the window
    with pytest.raises(ValueError):
        LinkStats(rtt_floor_window_s=0.0)


def test_backlogged_seconds_run_from_when_the_queue_last_filled():
    clk = FakeClock()
    ls = LinkStats("decode-0", clock=clk)
    assert ls.snapshot()["backlogged_s"] == 0.0
    ls.bytes_queued = 4096
    clk.t += 2.0
    ls.bytes_queued = 8192  # still queued: the run goes on
    clk.t += 1.5
    assert ls.snapshot()["backlogged_s"] == pytest.approx(3.5)
    ls.bytes_queued = 0
    assert ls.snapshot()["backlogged_s"] == 0.0
    ls.bytes_queued = 10
    clk.t += 0.25
    assert ls.snapshot()["backlogged_s"] == pytest.approx(0.25)


def test_windows_from_env_scales_the_time_windows_not_the_sampling_window():
    from common.transfer.link_stats import windows_from_env

    assert windows_from_env({}) == {}
    w = windows_from_env({"PRFAAS_LINK_STATS_TIME_SCALE": "5"})
    assert w == {"half_life_s": 1.0, "capacity_window_s": 6.0}
    assert windows_from_env({"PRFAAS_LINK_STATS_TIME_SCALE": "100"})["capacity_window_s"] == 1.0
    LinkStats(**w)  # accepted by the constructor
    for bad in ("0", "-1", "nan", "inf", "fast"):
        with pytest.raises(ValueError, match="PRFAAS_LINK_STATS_TIME_SCALE"):
            windows_from_env({"PRFAAS_LINK_STATS_TIME_SCALE": bad})


def test_a_scaled_capacity_window_forgets_the_old_capacity_sooner():
    """After the capacity drops, the estimate keeps the old peak for the capacity window only."""
    from common.transfer.link_stats import windows_from_env

    for scale, stale_after_20s in (("1", True), ("5", False)):
        s = LinkStats(clock=lambda: 0.0, **windows_from_env({"PRFAAS_LINK_STATS_TIME_SCALE": scale}))
        s._capacity.update(2e9, 0.0)  # a backlogged sample at 2 GB/s at t = 0
        assert (s.capacity_bytes_per_s(20.0) == 2e9) is stale_after_20s


def test_pings_still_out_bound_the_rtt_and_the_floor():
    """A path whose every connection waits for its pong behind queued KV reports at least that wait:
    before, its RTT and floor stood at the last samples (the floor at None once its window held
    none), which read as no congestion while the queue stood."""
    from common.transfer.estimators import rtt_with_pings_out

    assert rtt_with_pings_out(0.002, 0.001, None) == (0.002, 0.001)
    assert rtt_with_pings_out(0.002, None, 4.0) == (4.0, 4.0)
    assert rtt_with_pings_out(6.0, 0.5, 4.0) == (6.0, 0.5)  # a low sample in the window stays the floor
    assert rtt_with_pings_out(None, None, 3.0) == (3.0, 3.0)
    clk = FakeClock()
    ls = LinkStats("peer", rtt_floor_window_s=3.0, clock=clk)
    ls.on_rtt(0.002)
    clk.t += 5.0  # the floor's window has no sample now
    assert ls.snapshot()["rtt_floor_ms"] is None and ls.snapshot()["rtt_ms"] == pytest.approx(2.0)
    ls.note_pings_out(clk.t - 4.0)  # every connection's ping has waited 4 s or more
    s = ls.snapshot()
    assert s["rtt_ms"] == pytest.approx(4000.0) and s["rtt_floor_ms"] == pytest.approx(4000.0)
    clk.t += 1.0
    assert ls.snapshot()["rtt_floor_ms"] == pytest.approx(5000.0)  # still out: the bound grows
    ls.on_rtt(5.0)  # a pong: not every connection waits any more
    s = ls.snapshot()
    assert s["rtt_floor_ms"] == pytest.approx(5000.0) and s["rtt_ms"] < 5000.0


def test_rtt_floor_is_the_worst_connections():
    """Per connection, the lowest pong of the window (or its waiting ping's age without one); the
    largest over the connections. A path that serves its connections in turn drains the one holding
    few bytes first: its quick pongs must not hide the seconds of KV queued behind the others."""
    clk = FakeClock()
    ls = LinkStats("decode-0", rtt_floor_window_s=3.0, clock=clk)
    for _ in range(4):  # connection 0 runs dry and answers at once; connection 1 waits 2 s behind its bytes
        ls.on_rtt(0.001, conn=0)
        ls.on_rtt(2.0, conn=1)
        clk.t += 1.0
    assert ls.snapshot()["rtt_floor_ms"] == pytest.approx(2000.0)
    assert ls.rtt_floor() == pytest.approx(2.0)
    clk.t += 2.5  # connection 1's pongs left the window; its ping of an earlier round has waited 4 s
    ls.on_rtt(0.001, conn=0)
    ls.note_pings_out(None, {1: clk.t - 4.0})
    assert ls.snapshot()["rtt_floor_ms"] == pytest.approx(4000.0)
    ls.on_rtt(4.2, conn=1)  # its pong: a sample again, the ping no longer out
    assert ls.rtt_floor() == pytest.approx(4.2)
    clk.t += 10.0  # every sample aged out and no ping out: no floor, and the connections are forgotten
    assert ls.rtt_floor() is None and ls.snapshot()["rtt_floor_ms"] is None
    assert not ls._conn_floor
    # through one FIFO queue every connection waits alike: the worst connection's floor (0.30 s) is within
    # the pings' spread of the lowest of them all (0.29 s)
    fifo = LinkStats("decode-1", rtt_floor_window_s=3.0, clock=clk)
    for k, rtt in enumerate((0.30, 0.31, 0.29, 0.30)):
        fifo.on_rtt(rtt, conn=k % 2)
    assert fifo.rtt_floor() == pytest.approx(0.30)


def test_worst_connection_floor_reads_each_connections_window_else_its_ping():
    from common.transfer.estimators import worst_connection_floor

    assert worst_connection_floor([]) is None
    assert worst_connection_floor([(None, None)]) is None
    assert worst_connection_floor([(0.001, None), (2.0, None)]) == 2.0  # the loaded one, not the dry one
    assert worst_connection_floor([(0.001, 9.0), (None, 4.0)]) == 4.0  # a pong in the window outranks its ping out
