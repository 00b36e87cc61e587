"""Linux ``TCP_INFO``: what the kernel knows of one TCP connection (smoothed RTT, retransmits, lost
segments, congestion window, bytes acked...), parsed from ``struct tcp_info``.

:func:`read_tcp_info` reads it from a socket or an asyncio transport and never raises;
:meth:`TcpInfo.from_bytes` parses raw bytes. :class:`TcpInfo` keeps the kernel's units and names them
in its field names (``*_us`` microseconds, ``*_ms`` milliseconds, ``*_bytes_per_s``). Nothing here
does I/O besides ``getsockopt``; nothing is kept between calls.
"""

from __future__ import annotations

import enum
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["TCP_INFO_MIN_LEN", "TcpState", "TcpInfo", "as_socket", "read_tcp_info"]

_IS_LINUX = sys.platform.startswith("linux")
# Linux value of TCP_INFO (include/uapi/linux/tcp.h); Python exposes it as socket.TCP_INFO on Linux.
_TCP_INFO_OPT = getattr(socket, "TCP_INFO", 11)
# Ask for more than any kernel returns today; the kernel copies min(len, sizeof(struct tcp_info)).
_TCP_INFO_BUFLEN = 512

# Layout of ``struct tcp_info`` (Linux uapi ``linux/tcp.h``), native byte order. The struct is
# naturally aligned and every u64 falls on an 8-byte boundary, so offsets are plain sums.
#   offset 0..7    8 x u8 (state, ca_state, retransmits, probes, backoff, options,
#                  snd_wscale:4|rcv_wscale:4, delivery_rate_app_limited:1|fastopen_client_fail:2)
#   offset 8..103  24 x u32 (rto .. total_retrans)            -> 104 bytes: the stable prefix
#   offset 104     4 x u64 (pacing_rate, max_pacing_rate, bytes_acked, bytes_received)
#   offset 136     6 x u32 (segs_out, segs_in, notsent_bytes, min_rtt, data_segs_in, data_segs_out)
#   offset 160     4 x u64 (delivery_rate, busy_time, rwnd_limited, sndbuf_limited)
#   offset 192     2 x u32 (delivered, delivered_ce)
#   offset 200     2 x u64 (bytes_sent, bytes_retrans)
#   offset 216     5 x u32 (dsack_dups, reord_seen, rcv_ooopack, snd_wnd)  -> 232 bytes
_U8_FIELDS = ("state", "ca_state", "retransmits", "probes", "backoff", "options")
_U32_FIELDS = (
    "rto_us", "ato_us", "snd_mss", "rcv_mss",
    "unacked", "sacked", "lost", "retrans", "fackets",
    "last_data_sent_ms", "last_ack_sent_ms", "last_data_recv_ms", "last_ack_recv_ms",
    "pmtu", "rcv_ssthresh", "rtt_us", "rttvar_us", "snd_ssthresh", "snd_cwnd", "advmss",
    "reordering", "rcv_rtt_us", "rcv_space", "total_retrans",
)  # fmt: skip
_PREFIX_STRUCT = struct.Struct("=6BBB24I")
TCP_INFO_MIN_LEN = _PREFIX_STRUCT.size  # 104: the prefix every Linux >= 2.6 returns
assert TCP_INFO_MIN_LEN == 104

# Optional tail: (field, struct format, byte offset). A field is parsed only when the kernel returned
# all of its bytes; otherwise it is None.
_OPTIONAL_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("pacing_rate_bytes_per_s", "Q", 104),
    ("max_pacing_rate_bytes_per_s", "Q", 112),
    ("bytes_acked", "Q", 120),
    ("bytes_received", "Q", 128),
    ("segs_out", "I", 136),
    ("segs_in", "I", 140),
    ("notsent_bytes", "I", 144),
    ("min_rtt_us", "I", 148),
    ("data_segs_in", "I", 152),
    ("data_segs_out", "I", 156),
    ("delivery_rate_bytes_per_s", "Q", 160),
    ("busy_time_us", "Q", 168),
    ("rwnd_limited_us", "Q", 176),
    ("sndbuf_limited_us", "Q", 184),
    ("delivered", "I", 192),
    ("delivered_ce", "I", 196),
    ("bytes_sent", "Q", 200),
    ("bytes_retrans", "Q", 208),
    ("dsack_dups", "I", 216),
    ("reord_seen", "I", 220),
    ("rcv_ooopack", "I", 224),
    ("snd_wnd", "I", 228),
)


class TcpState(enum.IntEnum):
    """``tcpi_state`` values (Linux ``include/net/tcp_states.h``)."""

    ESTABLISHED = 1
    SYN_SENT = 2
    SYN_RECV = 3
    FIN_WAIT1 = 4
    FIN_WAIT2 = 5
    TIME_WAIT = 6
    CLOSE = 7
    CLOSE_WAIT = 8
    LAST_ACK = 9
    LISTEN = 10
    CLOSING = 11
    NEW_SYN_RECV = 12


@dataclass(frozen=True, slots=True)
class TcpInfo:
    """One ``getsockopt(IPPROTO_TCP, TCP_INFO)`` reading, in the kernel's units.

    Units: ``*_us`` microseconds, ``*_ms`` milliseconds (``last_*_ms`` are "time since", so they grow
    while the connection is idle), ``*_bytes_per_s`` bytes per second; ``snd_mss``, ``rcv_mss``,
    ``pmtu``, ``advmss``, ``rcv_space``, ``rcv_ssthresh``, ``notsent_bytes``, ``snd_wnd`` and the
    ``bytes_*`` fields are bytes; ``unacked``, ``sacked``, ``lost``, ``retrans``, ``fackets``,
    ``snd_cwnd``, ``snd_ssthresh``, ``total_retrans``, ``segs_*``, ``data_segs_*``, ``delivered*`` and
    ``reordering`` count segments (packets). ``retransmits`` is the number of consecutive unrecovered
    RTO timeouts; ``total_retrans`` is the connection's cumulative retransmitted-segment count.
    ``snd_ssthresh`` is ``0x7fffffff`` (``TCP_INFINITE_SSTHRESH``) until the first loss.

    The fields after ``total_retrans`` are None when the running kernel returned fewer bytes
    (``info_len`` is how many it returned).
    """

    state: int
    ca_state: int
    retransmits: int
    probes: int
    backoff: int
    options: int
    snd_wscale: int
    rcv_wscale: int
    delivery_rate_app_limited: bool
    fastopen_client_fail: int
    rto_us: int
    ato_us: int
    snd_mss: int
    rcv_mss: int
    unacked: int
    sacked: int
    lost: int
    retrans: int
    fackets: int
    last_data_sent_ms: int
    last_ack_sent_ms: int
    last_data_recv_ms: int
    last_ack_recv_ms: int
    pmtu: int
    rcv_ssthresh: int
    rtt_us: int
    rttvar_us: int
    snd_ssthresh: int
    snd_cwnd: int
    advmss: int
    reordering: int
    rcv_rtt_us: int
    rcv_space: int
    total_retrans: int
    info_len: int
    pacing_rate_bytes_per_s: int | None = None
    max_pacing_rate_bytes_per_s: int | None = None
    bytes_acked: int | None = None
    bytes_received: int | None = None
    segs_out: int | None = None
    segs_in: int | None = None
    notsent_bytes: int | None = None
    min_rtt_us: int | None = None
    data_segs_in: int | None = None
    data_segs_out: int | None = None
    delivery_rate_bytes_per_s: int | None = None
    busy_time_us: int | None = None
    rwnd_limited_us: int | None = None
    sndbuf_limited_us: int | None = None
    delivered: int | None = None
    delivered_ce: int | None = None
    bytes_sent: int | None = None
    bytes_retrans: int | None = None
    dsack_dups: int | None = None
    reord_seen: int | None = None
    rcv_ooopack: int | None = None
    snd_wnd: int | None = None

    @property
    def tcp_state(self) -> TcpState | int:
        """``state`` as a :class:`TcpState` (the raw int if the kernel reports an unknown value)."""
        try:
            return TcpState(self.state)
        except ValueError:
            return self.state

    @property
    def rtt_s(self) -> float:
        """The kernel's smoothed RTT (``rtt_us``) in seconds."""
        return self.rtt_us / 1e6

    @classmethod
    def from_bytes(cls, buf: bytes) -> TcpInfo:
        """Parse a raw ``struct tcp_info`` in native byte order.

        Raises ValueError if ``buf`` is shorter than :data:`TCP_INFO_MIN_LEN` (104) bytes.
        """
        n = len(buf)
        if n < TCP_INFO_MIN_LEN:
            raise ValueError(f"tcp_info too short: {n} bytes < {TCP_INFO_MIN_LEN}")
        vals = _PREFIX_STRUCT.unpack_from(buf, 0)
        u8 = vals[:6]
        wscale, flags = vals[6], vals[7]
        # C bit-fields are allocated from the least significant bit on little-endian ABIs and from
        # the most significant bit on big-endian ones.
        if sys.byteorder == "little":
            snd_wscale, rcv_wscale = wscale & 0x0F, wscale >> 4
            app_limited, fo_fail = flags & 0x1, (flags >> 1) & 0x3
        else:
            snd_wscale, rcv_wscale = wscale >> 4, wscale & 0x0F
            app_limited, fo_fail = flags >> 7, (flags >> 5) & 0x3
        kw: dict[str, Any] = dict(zip(_U8_FIELDS, u8))
        kw.update(snd_wscale=snd_wscale, rcv_wscale=rcv_wscale,
                  delivery_rate_app_limited=bool(app_limited), fastopen_client_fail=fo_fail)
        kw.update(zip(_U32_FIELDS, vals[8:]))
        kw["info_len"] = n
        for name, fmt, off in _OPTIONAL_FIELDS:
            size = struct.calcsize("=" + fmt)
            if off + size > n:
                break
            kw[name] = struct.unpack_from("=" + fmt, buf, off)[0]
        return cls(**kw)


def as_socket(sock_or_transport: Any) -> Any:
    """The socket-like object behind ``sock_or_transport`` (an asyncio transport or a socket)."""
    get_extra = getattr(sock_or_transport, "get_extra_info", None)
    if get_extra is not None and not hasattr(sock_or_transport, "getsockopt"):
        return get_extra("socket")
    return sock_or_transport


def read_tcp_info(sock: Any) -> TcpInfo | None:
    """Read ``TCP_INFO`` from a TCP socket or an asyncio transport.

    ``sock`` may be a :class:`socket.socket`, anything with ``getsockopt`` (asyncio's
    ``TransportSocket``, uvloop's pseudo-socket), or an asyncio transport/``StreamWriter``-like
    object with ``get_extra_info("socket")``.

    Returns None, never raises, when the information is not available: not Linux, not a TCP socket
    (UDP, Unix), a closed socket or transport, a transport without a socket, or a kernel answer
    shorter than the 104-byte stable prefix. (A socket that is open but not connected yet still
    answers, with ``state`` other than ESTABLISHED.)
    """
    if not _IS_LINUX or sock is None:
        return None
    try:
        s = as_socket(sock)
        if s is None:
            return None
        fileno = getattr(s, "fileno", None)
        if fileno is not None and fileno() < 0:
            return None
        buf = s.getsockopt(socket.IPPROTO_TCP, _TCP_INFO_OPT, _TCP_INFO_BUFLEN)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    if not isinstance(buf, (bytes, bytearray)) or len(buf) < TCP_INFO_MIN_LEN:
        return None
    return TcpInfo.from_bytes(bytes(buf))
