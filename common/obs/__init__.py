"""Observability shared by every service: request ids in logs (:mod:`common.obs.logctx`), the
per-service ``/metrics`` and ``/health`` listener (:mod:`common.obs.http`), latency histograms
(:mod:`common.obs.histograms`) and the metric families built from a service's state
(:mod:`common.obs.families`)."""
