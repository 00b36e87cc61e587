"""Discrete-event simulator of a PrfaaS deployment that drives the project's own policy code.

``events`` (the clock and event queue), ``link`` (a shared link with flow-level fair sharing between
sender paths, each first in first out), ``pings`` (the KV senders' RTT probes, per path),
``instances`` (prefill and decode instances), ``engine`` (the deployment: the router's placement,
leases, KV index and prefix caches, the planner's loops), ``workload`` (arrivals and lengths).
``scripts/simulate.py`` is the command line.
"""
