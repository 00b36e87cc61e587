"""KV link congestion signals as Prometheus metric families (built with ``prometheus_client``).

:func:`link_metric_families` turns :class:`~common.transfer.link_stats.LinkStats` snapshots into
``prometheus_client`` metric families, one family per signal with one sample per link; a caller puts
them on a ``/metrics`` page with ``prometheus_client.exposition.generate_latest`` over a collector that
returns them. ``prometheus_client`` does the text format, including escaping label values.

Stateless: nothing here keeps or frees anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.validation import (
    METRIC_LABEL_NAME_RE,
    METRIC_NAME_RE,
    RESERVED_METRIC_LABEL_NAME_RE,
)

from common.transfer.link_stats import LinkStats

__all__ = ["link_metric_families"]

# (snapshot key, metric suffix, type, scale to base unit, help)
_LINK_METRICS: tuple[tuple[str, str, str, float, str], ...] = (
    ("connections", "connections", "gauge", 1, "TCP connections of the link read at the latest sample."),
    ("goodput_bps", "goodput_bits_per_second", "gauge", 1, "Goodput EWMA over send windows, bits/s."),
    ("tcp_goodput_bps", "tcp_goodput_bits_per_second", "gauge", 1, "Goodput EWMA from TCP bytes acked, bits/s."),
    ("bytes_sent", "bytes_sent_total", "counter", 1, "Bytes written and drained on the link."),
    ("bytes_queued", "bytes_queued", "gauge", 1, "Bytes waiting in the engine's send queues."),
    ("backlogged_s", "backlogged_seconds", "gauge", 1, "Seconds the engine's send queue has stayed non-empty."),
    ("rtt_ms", "rtt_seconds", "gauge", 1e-3, "Application ping/pong RTT EWMA, seconds."),
    ("rtt_min_ms", "rtt_min_seconds", "gauge", 1e-3, "Smallest application ping/pong RTT, seconds."),
    ("rtt_floor_ms", "rtt_floor_seconds", "gauge", 1e-3,
     "Smallest application ping/pong RTT of the last few seconds (a standing queue lifts it), seconds."),
    ("tcp_srtt_ms", "tcp_srtt_seconds", "gauge", 1e-3, "Mean kernel smoothed RTT over connections, seconds."),
    ("tcp_srtt_max_ms", "tcp_srtt_max_seconds", "gauge", 1e-3, "Largest kernel smoothed RTT over connections, seconds."),
    ("tcp_lost", "tcp_lost_segments", "gauge", 1, "Segments the kernel considers lost, summed over connections."),
    ("tcp_unacked", "tcp_unacked_segments", "gauge", 1, "Unacknowledged segments, summed over connections."),
    ("tcp_snd_cwnd", "tcp_snd_cwnd_segments", "gauge", 1, "Congestion windows, summed over connections, segments."),
    ("tcp_notsent_bytes", "tcp_notsent_bytes", "gauge", 1, "Bytes in kernel send buffers not yet sent."),
    ("retransmits", "retransmits_total", "counter", 1, "Retransmitted TCP segments."),
    ("retransmits_window", "retransmits_window", "gauge", 1, "Retransmitted TCP segments since the previous sample."),
    ("stalls", "stalls_total", "counter", 1, "Connection stalls seen by the engine."),
    ("reconnects", "reconnects_total", "counter", 1, "Connection reconnects."),
    ("kv_raw_bytes", "kv_raw_bytes_total", "counter", 1, "KVCache bytes queued on the link, before the wire codec."),
    ("kv_wire_bytes", "kv_wire_bytes_total", "counter", 1, "Bytes those KVCache bytes became on the wire."),
    ("codec_ratio", "codec_ratio", "gauge", 1, "KVCache bytes per wire byte over the link's life (1: no codec)."),
    ("capacity_bps", "capacity_bits_per_second", "gauge", 1,
     "Link capacity estimate: largest backlogged bytes-acked rate in the capacity window, bits/s."),
)


def _link_labels(labels: Mapping[str, Any]) -> dict[str, str]:
    """``labels`` with str values; raises ValueError for an invalid or reserved (``__``) label name."""
    for name in labels:
        if not isinstance(name, str) or not METRIC_LABEL_NAME_RE.match(name):
            raise ValueError(f"invalid Prometheus label name: {name!r}")
        if RESERVED_METRIC_LABEL_NAME_RE.match(name):
            raise ValueError(f"label names starting with '__' are reserved: {name!r}")
    return {k: str(v) for k, v in labels.items()}


def link_metric_families(
    prefix: str, links: Iterable[tuple[Mapping[str, Any], Mapping[str, Any] | LinkStats]], bytes_per_second: bool = False
) -> list[Metric]:
    """Link snapshots as Prometheus metric families, one sample per link in each.

    ``links`` holds ``(labels, snapshot_or_LinkStats)`` pairs (a :class:`LinkStats` is snapshotted
    now; label values are rendered with ``str``). Family names are ``{prefix}_{suffix}``; RTTs are
    converted from the snapshot's milliseconds to seconds (``*_seconds``), goodput and capacity are
    bits/s, byte and segment counts are as in the snapshot; cumulative counts are counters whose
    samples end in ``_total``. Values that are None in a snapshot (no sample yet) are left out, and a
    family with no sample at all is not returned. Sample values are floats.

    Raises ValueError for an invalid metric prefix or label name (including reserved ``__`` names),
    judged by Prometheus' classic name rules, or two links with the same label set.

    ``bytes_per_second``: goodput and capacity in the base unit Prometheus asks for (bytes/s, named
    ``*_bytes_per_second``), as a service's own ``/metrics`` shows them; the gateway's relayed view
    keeps bits/s.
    """
    if not isinstance(prefix, str) or not METRIC_NAME_RE.match(prefix):
        raise ValueError(f"invalid Prometheus metric prefix: {prefix!r}")
    rows: list[tuple[dict[str, str], Mapping[str, Any]]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for labels, snap in links:
        if isinstance(snap, LinkStats):
            snap = snap.snapshot()
        lab = _link_labels(labels)
        key = frozenset(lab.items())
        if key in seen:
            raise ValueError(f"duplicate label set {lab}")
        seen.add(key)
        rows.append((lab, snap))
    families: list[Metric] = []
    for key, suffix, mtype, scale, help_text in _LINK_METRICS:
        if bytes_per_second and suffix.endswith("_bits_per_second"):
            suffix, scale, help_text = suffix.replace("_bits_", "_bytes_"), scale / 8, help_text.replace("bits/s", "bytes/s")
        name = f"{prefix}_{suffix}"
        family = (CounterMetricFamily if mtype == "counter" else GaugeMetricFamily)(name, help_text)
        sample_name = f"{family.name}_total" if mtype == "counter" else family.name
        for lab, snap in rows:
            v = snap.get(key)
            if v is not None:
                family.add_sample(sample_name, lab, float(v) * scale)
        if family.samples:
            families.append(family)
    return families
