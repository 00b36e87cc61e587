"""Several PrfaaS clusters feeding one PD cluster, each over its own link: the emulated deployment
of :class:`~common.lab.emulated_cluster.EmulatedCluster` with named sites.

:class:`MultiCluster` starts the real planner, router and gateway with a topology file
(``services/planner/topology.py``) naming every site and the PD cluster ``pd``, the PD cluster's
instances in one host process, and each :class:`Site`'s PrfaaS prefill workers in a host process of
its own, behind its own :class:`~common.lab.topology.WanLink`::

    PD cluster "pd":  gateway, router, planner, host "pd" (PD-P and PD-D workers)
    site "<s>":        host "<s>" (its PrfaaS prefill workers, cluster "<s>", hardware profile of the site)
    decode --prefill RPC--> [rpc:<worker>] on link <s> --> site worker
    site worker --KVCache--> [kv:<pd worker>] on link <s> --> PD worker's KV listener
                             (each PD worker advertises one KV address per site: --kv-advertise-for)
    site worker --reports, cache events--> [planner], [router] on link <s>

A site's workers share one KV gate (``--kv-share-group <site>``: one window, paced at the link's
measured capacity, chunks in priority-weighted order), and each is paced per class at the rates the
planner grants it in its report answers (``kv_grants``, :mod:`services.planner.link_grants`).

Blackholing a site's link (:meth:`MultiCluster.stall`) stops its KVCache and its workers' reports:
the planner marks them dead after its heartbeat, in-flight transfers fail at the decode worker's
stall deadline and are placed again on another site. Ownership as in ``EmulatedCluster``; every link
is closed by :meth:`stop`. Units: unscaled Gbit/s for links, seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.lab.cluster import free_port
from common.lab.emulated_cluster import LOCAL, EmulatedCluster
from common.lab.topology import WanLink
from common.model.emulated import EmulatedProfile


@dataclass(frozen=True)
class Site:
    """One PrfaaS cluster: ``name`` (its cluster name), ``n`` instances of ``profile`` and its link's
    capacity ``link_gbps`` (unscaled)."""

    name: str
    n: int
    profile: str = "h200_table5"
    link_gbps: float = 100.0
    profiles: tuple[str, ...] = ()  # per instance, when the site mixes hardware (else ``profile`` for all)

    def profile_of(self, k: int) -> str:
        return self.profiles[k] if self.profiles else self.profile


@dataclass
class MultiCluster(EmulatedCluster):
    """See the module docstring. ``shape`` gives the PD cluster (``n_prfaas`` is ignored: the sites
    are ``sites``); ``kv_stall_s``: the decode workers' KV stall deadline (real seconds)."""

    sites: tuple[Site, ...] = ()
    kv_stall_s: float = 2.0
    links: dict[str, WanLink] = field(default_factory=dict)

    def topology(self) -> dict[str, Any]:
        """The topology file's object: every site, ``pd``, and a link from each site into ``pd``."""
        pd_t = EmulatedProfile.from_file(self.pd_profile).t_prefill(32_768)

        def speed(s: Site) -> float:  # mean prefill speed of its instances relative to the PD hardware, at 32K tokens
            return sum(pd_t / EmulatedProfile.from_file(s.profile_of(k)).t_prefill(32_768) for k in range(s.n)) / s.n

        clusters = [{"name": s.name, "kind": "prfaas", "profile": s.profile_of(0), "speed": speed(s)} for s in self.sites]
        return {"clusters": [*clusters, {"name": "pd", "kind": "pd", "profile": self.pd_profile}],
                "links": [{"src": s.name, "dst": "pd", "gbps": s.link_gbps} for s in self.sites]}

    def _workers(self, site: Site) -> list[str]:
        return [f"{site.name}-{k}" for k in range(site.n)]

    def commands(self) -> dict[str, list[str]]:
        a, py = self.addrs, [sys.executable, "-m"]
        topo = str(Path(self.log_dir) / "topology.json")
        cmds = super().commands()  # planner, router, gateway and host-pd; n_prfaas must be 0 (no host-prfaas)
        cmds["planner"] += ["--topology", topo, *([] if "--router" in cmds["planner"] else ["--router", a["router"]]),
                            "--loop-interval", repr(1.0 / self.scales.time_scale)]
        fixed = {s.name: EmulatedProfile.from_file(s.profile_of(0)).prefill_fixed_tokens() / self.scales.token_scale for s in self.sites}
        cmds["router"] += ["--topology", topo, *(f for n, v in fixed.items() for f in ("--prefill-fixed-tokens", f"{n}={v!r}"))]
        pd_host = cmds["host-pd"]
        out, spec = [], []
        for arg in pd_host[3:] + ["--"]:  # add one KV address per site to every PD worker
            if arg == "--" and spec:
                name = spec[spec.index("--name") + 1]
                spec += [f for s in self.sites for f in ("--kv-advertise-for", f"{s.name}={a[f'kv:{s.name}:{name}']}")]
                spec += ["--kv-receive-stall-timeout", repr(self.kv_stall_s)]
                out += (["--"] if out else []) + spec
                spec = []
            else:
                spec.append(arg)
        cmds["host-pd"] = pd_host[:3] + out
        common = ["--backend", "emulated", "--kv-connections", "2", "--prefix-cache-bytes", str(self.prefix_cache_bytes),
                  "--report-interval", "0.25"]
        for s in self.sites:
            specs: list[str] = []
            for k, n in enumerate(self._workers(s)):
                specs += ["--", "prefill", "--name", n, "--cluster", s.name, "--listen", a[n], "--advertise", a[f"rpc:{n}"],
                          "--planner", a[f"planner:{s.name}"], "--router", a[f"router:{s.name}"],
                          "--emulated-profile", s.profile_of(k), "--kv-share-group", s.name, *common]
            cmds[f"host-{s.name}"] = py + ["common.lab.emulated_host", *specs[1:]]
        return cmds

    async def start(self, timeout: float = 120.0) -> MultiCluster:
        """Every link, then every process; waits until every worker is registered and the gateway healthy."""
        if self.shape.n_prfaas:
            raise ValueError("a MultiCluster's PrfaaS instances are its sites; give a shape with n_prfaas=0")
        if self.log_dir is None:
            import tempfile
            self.log_dir = Path(tempfile.mkdtemp(prefix="prfaas-multi-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "topology.json").write_text(json.dumps(self.topology()))
        a = self.addrs
        for n in ("planner", "router", "gateway"):
            a[n] = f"{LOCAL}:{free_port()}"
        pds = [f"pd-{k}" for k in range(self.shape.n_p + self.shape.n_d)]
        for n in pds:
            a[n], a[f"{n}:kv"] = f"{LOCAL}:{free_port()}", f"{LOCAL}:{free_port()}"
            a[f"kv:{n}"] = a[f"{n}:kv"]  # the base class's --kv-advertise-remote: direct (each site has its own below)
        for s in self.sites:
            link = self.links[s.name] = WanLink(max_buffer_bytes=4 << 20)
            for n in self._workers(s):
                a[n] = f"{LOCAL}:{free_port()}"
                a[f"rpc:{n}"] = link.add(f"rpc:{n}", LOCAL, a[n], client_side="local", shaped=False)
            for n in pds:
                a[f"kv:{s.name}:{n}"] = link.add(f"kv:{n}", LOCAL, a[f"{n}:kv"], client_side="prfaas")
            a[f"planner:{s.name}"] = link.add("planner", LOCAL, a["planner"], client_side="prfaas", shaped=False)
            a[f"router:{s.name}"] = link.add("router", LOCAL, a["router"], client_side="prfaas", shaped=False)
            link.configure(rate_bps=self.wire_rate_bps(s.link_gbps))
            await link.start()
        await self._launch(timeout)
        return self

    async def _wait_healthy(self, timeout: float) -> None:
        """The base class's wait (every worker registered, the gateway healthy), then until the router
        holds every site's link into the PD cluster as up: until the planner's link loop has reported
        them, the router has no pair with headroom and places a long prompt locally, so a run's first
        requests would not take the routes its topology names. Raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        n_sites = sum(s.n for s in self.sites)
        self.shape = type(self.shape)(self.shape.name, n_sites, self.shape.n_p, self.shape.n_d)  # counted by the base
        try:
            await super()._wait_healthy(timeout)
        finally:
            self.shape = type(self.shape)(self.shape.name, 0, self.shape.n_p, self.shape.n_d)
        want = {f"{s.name}->{self.shape.name}" for s in self.sites}
        while True:
            links = ((await self.router_stats()).get("topology") or {}).get("links") or {}
            if all((links.get(k) or {}).get("up") for k in want):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router did not hold the links {sorted(want)} up within {timeout:g}s: {links}")
            await asyncio.sleep(0.1)

    async def _close_links(self) -> None:
        for link in self.links.values():
            await link.close()

    # ------------------------------------------------------------------ control and probes
    def set_site_link(self, site: str, link_gbps: float) -> None:
        """Set site ``site``'s link capacity to ``link_gbps`` unscaled."""
        self.links[site].configure(rate_bps=self.wire_rate_bps(link_gbps))

    def stall(self, site: str) -> None:
        """Blackhole site ``site``'s link: nothing crosses it either way; connections stay open."""
        self.links[site].stall()

    def resume(self, site: str) -> None:
        self.links[site].resume()

    def site_kv_bytes(self, site: str) -> int:
        """KV bytes delivered so far over site ``site``'s link."""
        return self.links[site].delivered_bytes("kv:")

    def kv_wire_bytes(self) -> int:
        return sum(self.site_kv_bytes(s.name) for s in self.sites)
