"""Read a gateway's ``/metrics`` page back: one sample's value from Prometheus text (tests, lab tools)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` (as written, e.g. ``prfaas_requests_total``) whose labels are
    exactly ``labels`` in the Prometheus ``text``, or None when there is none. Raises ValueError for
    text that does not parse."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None
