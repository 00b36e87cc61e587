"""A two-datacenter network lab on one machine: two network namespaces joined by a shaped veth pair.

The lab models the cross-datacenter link of PrfaaS: the ``prfaas`` namespace holds the remote prefill
cluster, the ``local`` namespace the PD cluster, and the only path between them is one veth pair whose
two ends carry ``tc`` shaping (bandwidth with ``tbf``; delay, jitter and loss with ``netem`` where the
kernel has it). Nothing is routed to or from the host's own network: the /30 used for the link exists
only inside the two namespaces, and each namespace has just ``lo`` and its veth end.

Library::

    from common.lab.netlab import TwoDatacenters, netns_available, netem_available, cleanup

    with TwoDatacenters(prefix="prfaas-lab") as lab:
        lab.shape(rate_bit=100_000_000)                  # 100 Mbit/s each way
        srv = lab.run("local", ["python", "-m", "http.server", "--bind", lab.addr("local"), "9000"])
        cli = lab.run("prfaas", ["curl", f"http://{lab.addr('local')}:9000/"])

CLI::

    python -m common.lab.netlab check                       # root? ip? netns? netem?
    python -m common.lab.netlab up [--prefix P] [--rate-mbit 100] [--delay-ms 20]
    python -m common.lab.netlab down [--prefix P]           # also cleans up after a crashed run

Requirements: root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and iproute2 (``ip``, ``tc``).

Bandwidth shaping (``tbf``) and why these values
-------------------------------------------------
``shape(rate_bit=R)`` installs on each veth end (egress, so each direction is shaped once)::

    tc qdisc add dev <veth> root tbf rate R burst B limit L

* ``burst B = max(128 KiB, R/8 * 2 ms)`` -- 128 KiB at 100 Mbit/s, 250 KB at 1 Gbit/s. veth has
  GSO/TSO, so TCP hands the qdisc super-packets of up to 64 KiB; a bucket smaller than one of them
  makes tbf segment each one in software before metering it, and a small bucket also means one timer
  wake-up per few packets. Two super-packets (128 KiB), or 2 ms at the link rate if that is more, keep
  tbf on its fast path and its wake-ups to a few hundred per second. The burst only lets that many
  bytes out at line rate after an idle period: on a bulk transfer of megabytes it moves the average by
  well under 1 %.
* ``limit L = max(4 * B, R/8 * 40 ms)`` -- the queue in front of the bucket, in bytes: 512 KiB at
  100 Mbit/s, 5 MB at 1 Gbit/s. TCP fills whatever queue it is given; a queue of only a few
  super-packets makes tbf drop from every burst, a huge one only adds queueing delay (bufferbloat).
  40 ms at the link rate holds TCP's bursts without drops and keeps the RTT realistic for a
  cross-datacenter link.

Measured on the development VM (2 vCPUs, kernel 6.18, BBR, 1500-byte MTU), one bulk TCP stream from
the prfaas to the local namespace, goodput at the receiver:

======================  ==============  ==========================================
shaping                 tbf burst       goodput
======================  ==============  ==========================================
100 Mbit/s, 25 MB       128 KiB         96.0 Mbit/s (96 %), 0 drops, ~1.6k overlimits
100 Mbit/s, 25 MB       3 KB / 16 KiB   95.2 / 95.5 Mbit/s, ~35k overlimits (timer wake-ups)
1 Gbit/s, 100 MB        250 KB          954 Mbit/s (95.4 %), 0 drops
1 Gbit/s, 100 MB        16 KiB          910 Mbit/s (91 %): CPU-bound on small buckets
======================  ==============  ==========================================

tbf meters whole Ethernet frames, so 66 bytes of Ethernet/IP/TCP headers per 1448-byte segment
(about 4.4 %) come off the top: ~95.6 % of the configured rate (plus the initial burst) is what a
long TCP transfer's payload can get.

Delay, jitter and loss
----------------------
These need the ``sch_netem`` kernel module. :func:`netem_available` probes for it (on a throwaway
veth in a throwaway namespace). With netem, ``shape`` installs ``netem`` as the root qdisc and ``tbf``
as its child (the layout from ``tc-netem(8)``). Without netem, asking for ``delay_ms``,
``jitter_ms`` or ``loss_pct`` raises :class:`NetemUnavailable`: run the traffic through the userspace
proxy instead (``common.lab.link_proxy.LinkProxy``, which adds one-way delay, jitter, rate caps, stalls
and resets from user space), e.g. a proxy in the ``local`` namespace that forwards to the ``prfaas``
address. :attr:`TwoDatacenters.needs_userspace_proxy` lists what was asked for and could not be done
in the kernel.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from common.lab.environ import EnvOverlay, has_secret

SIDES = ("prfaas", "local")
_VETH = {"prfaas": "veth-prfaas", "local": "veth-local"}  # interface names inside each namespace


class NetlabError(RuntimeError):
    """A lab command failed (the message carries the command and its stderr)."""


class NetemUnavailable(NetlabError):
    """Delay, jitter or loss was asked for but the kernel has no ``netem`` qdisc (use ``LinkProxy``)."""


def _ip_tool() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)


def _tc_tool() -> str | None:
    return shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(p)), None)


def _sh(argv: Sequence[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run a short command; with ``check`` raise :class:`NetlabError` carrying its stderr on failure."""
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise NetlabError(f"{' '.join(argv)!r} failed (rc={p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh([_ip_tool() or "ip", *args], check=check)


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``), empty if ``ip`` fails."""
    if _ip_tool() is None:
        return []
    p = _ip("netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    p = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split() if x.strip().isdigit()]


def _kill_ns_processes(ns: str, wait_s: float = 3.0) -> None:
    """SIGKILL every process inside namespace ``ns`` and wait (up to ``wait_s`` s) for them to go."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _delete_ns(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it; a namespace that is already gone is fine."""
    if ns not in list_namespaces():
        return
    _kill_ns_processes(ns)
    _ip("netns", "delete", ns, check=False)


def netns_available() -> tuple[bool, str]:
    """Whether this process can build the lab: ``(ok, reason)``.

    Checks root, that ``ip`` exists, and that a throwaway namespace can be created, entered with
    ``ip netns exec`` and deleted.
    """
    if os.geteuid() != 0:
        return False, "not root (network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    if _ip_tool() is None:
        return False, "iproute2 'ip' not found"
    probe = f"netlab-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        p = _ip("netns", "add", probe, check=False)
        if p.returncode != 0:
            return False, f"cannot create a network namespace: {p.stderr.strip()}"
        p = _sh([_ip_tool(), "netns", "exec", probe, "true"], check=False)
        if p.returncode != 0:
            return False, f"cannot enter a network namespace: {p.stderr.strip()}"
        return True, "ok"
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"network namespace probe failed: {e}"
    finally:
        _ip("netns", "delete", probe, check=False)


@functools.cache
def tbf_available() -> bool:
    """Whether ``tc qdisc add ... tbf`` works (probed on a veth in a throwaway namespace)."""
    return _probe_qdisc(["tbf", "rate", "10mbit", "burst", "32kb", "limit", "64kb"])


@functools.cache
def netem_available() -> bool:
    """Whether ``tc qdisc add ... netem`` works (the ``sch_netem`` module), probed on a throwaway
    veth in a throwaway namespace that is deleted afterwards. Cached for the process."""
    return _probe_qdisc(["netem", "delay", "1ms"])


def _probe_qdisc(qdisc: list[str]) -> bool:
    ok, _ = netns_available()
    if not ok or _tc_tool() is None:
        return False
    probe = f"netlab-qprobe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        if _ip("netns", "add", probe, check=False).returncode != 0:
            return False
        ex = [_ip_tool(), "netns", "exec", probe]
        if _sh([*ex, _ip_tool(), "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
               check=False).returncode != 0:
            return False
        p = _sh([*ex, _tc_tool(), "qdisc", "add", "dev", "probe0", "root", *qdisc], check=False)
        return p.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        _ip("netns", "delete", probe, check=False)  # takes the veth pair with it


def cleanup(prefix: str = "prfaas-lab") -> list[str]:
    """Remove a lab left behind by a crashed run: kill the processes in ``<prefix>-prfaas`` and
    ``<prefix>-local`` and delete both namespaces. Returns the names deleted (idempotent)."""
    gone = []
    for side in SIDES:
        ns = f"{prefix}-{side}"
        if ns in list_namespaces():
            _delete_ns(ns)
            gone.append(ns)
    return gone


def tbf_params(rate_bit: int, burst_bytes: int | None = None) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a tbf at ``rate_bit`` bit/s (see the module docstring)."""
    rate_Bps = rate_bit / 8
    burst = burst_bytes if burst_bytes is not None else max(128 * 1024, int(rate_Bps * 0.002))
    limit = max(4 * burst, int(rate_Bps * 0.040))
    return burst, limit


class TwoDatacenters:
    """Two network namespaces, ``<prefix>-prfaas`` and ``<prefix>-local``, joined by a veth pair.

    ``subnet`` must be a /30 (or larger) private network; its first host goes to the prfaas side,
    the second to the local side (``10.203.0.1`` and ``10.203.0.2`` by default). Both namespaces get
    ``lo`` up, so each side can also serve on ``127.0.0.1`` privately.

    Use as a context manager (``__enter__`` = :meth:`up`, ``__exit__`` = :meth:`down`), or call
    :meth:`up` / :meth:`down` directly. :meth:`down` kills every process started with :meth:`run`
    and anything else still inside the namespaces, then deletes both; it runs even if :meth:`up`
    failed half-way, and calling it twice is harmless.
    """

    def __init__(self, prefix: str = "prfaas-lab", subnet: str = "10.203.0.0/30"):
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
        if self.subnet.num_addresses < 4 or not self.subnet.is_private:
            raise ValueError(f"subnet must be a private /30 or larger, got {subnet}")
        hosts = list(self.subnet.hosts())[:2] if self.subnet.num_addresses <= 256 else [
            self.subnet.network_address + 1, self.subnet.network_address + 2]
        self._addr = {"prfaas": str(hosts[0]), "local": str(hosts[1])}
        self.ns = {side: f"{prefix}-{side}" for side in SIDES}
        self.veth = dict(_VETH)
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._env = EnvOverlay()  # up() may put a fresh PRFAAS_SHARED_SECRET in os.environ; down() removes it
        self.shaping: dict[str, Any] | None = None
        self.needs_userspace_proxy: list[str] = []

    # ----------------------------------------------------------------- lifecycle
    def up(self) -> TwoDatacenters:
        """Create both namespaces, the veth pair with its addresses, and bring all links up."""
        ok, reason = netns_available()
        if not ok:
            raise NetlabError(f"network namespaces unavailable: {reason}")
        try:
            for side in SIDES:
                ns = self.ns[side]
                if ns in list_namespaces():
                    raise NetlabError(f"namespace {ns} already exists (left by a crashed run? "
                                      f"run: python common/lab/netlab.py down --prefix {self.prefix})")
                _ip("netns", "add", ns)
                self._created.append(ns)
            p, l = self.ns["prfaas"], self.ns["local"]
            # Create the pair inside the prfaas namespace and move its peer straight into the local one,
            # so no interface ever appears in the host's namespace.
            self._exec(p, _ip_tool(), "link", "add", self.veth["prfaas"], "type", "veth",
                       "peer", "name", self.veth["local"], "netns", l)
            plen = self.subnet.prefixlen
            for side in SIDES:
                ns, dev = self.ns[side], self.veth[side]
                self._exec(ns, _ip_tool(), "addr", "add", f"{self._addr[side]}/{plen}", "dev", dev)
                self._exec(ns, _ip_tool(), "link", "set", dev, "up")
                self._exec(ns, _ip_tool(), "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        if not has_secret():
            # services bound to the lab's (non-loopback) addresses refuse to run without a secret, and
            # every process started from here on (in the lab or beside it) inherits this one
            self._env.set("PRFAAS_SHARED_SECRET", uuid.uuid4().hex)
        return self

    def down(self) -> None:
        """Kill processes started in the lab, then delete the namespaces this object created."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        proc.kill()
                    except ProcessLookupError:
                        pass
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for ns in self._created:
            _delete_ns(ns)
        self._created.clear()
        self._env.restore()

    def __enter__(self) -> TwoDatacenters:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ----------------------------------------------------------------- use
    def addr(self, side: str) -> str:
        """The IPv4 address of ``side`` ("prfaas" or "local") on the inter-datacenter link."""
        return self._addr[self._side(side)]

    def run(self, ns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside a namespace (``ns`` is a side name or the full namespace name) via
        ``ip netns exec``. Extra keyword arguments go to :class:`subprocess.Popen`; by default the
        child gets its own session so :meth:`down` can kill its whole process group."""
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen([*self.exec_prefix(ns), *argv], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def exec_prefix(self, ns: str) -> list[str]:
        """The argv prefix that runs a command inside a namespace (``ip netns exec NAME``), for
        launchers that start processes themselves; ``ip`` execs the command in place, so the
        process id is the command's own."""
        return [_ip_tool() or "ip", "netns", "exec", self.ns[self._side(ns)]]

    def exec(self, ns: str, argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
        """Run a short command inside a namespace and wait for it (stdout/stderr captured as text)."""
        return self._exec(self.ns[self._side(ns)], *argv, check=check)

    def shape(self, rate_bit: int | None, delay_ms: float = 0, jitter_ms: float = 0, loss_pct: float = 0,
              burst_bytes: int | None = None) -> dict[str, Any]:
        """Shape both directions of the link (each veth end's egress).

        ``rate_bit``: bandwidth in bit/s (``None``: unlimited), via ``tbf`` with the burst and limit of
        :func:`tbf_params` (``burst_bytes`` overrides the burst). ``delay_ms`` / ``jitter_ms``: one-way
        delay and its +/- variation in milliseconds, ``loss_pct``: random loss in percent -- these need
        ``netem``; without it they raise :class:`NetemUnavailable` (see the module docstring) and are
        recorded in :attr:`needs_userspace_proxy`. Replaces any earlier shaping; returns what was set.
        """
        impaired = [k for k, v in (("delay_ms", delay_ms), ("jitter_ms", jitter_ms), ("loss_pct", loss_pct)) if v]
        if impaired and not netem_available():
            self.needs_userspace_proxy = impaired
            raise NetemUnavailable(
                f"{', '.join(impaired)}: needs the netem qdisc, which this kernel lacks; shape bandwidth only "
                "here and add delay/jitter/loss with common.lab.link_proxy.LinkProxy (userspace) instead")
        if rate_bit is not None and rate_bit <= 0:
            raise ValueError("rate_bit must be positive or None")
        self.clear_shaping()
        tc = _tc_tool() or "tc"
        burst = limit = None
        if rate_bit is not None:
            burst, limit = tbf_params(rate_bit, burst_bytes)
        for side in SIDES:
            ns, dev = self.ns[side], self.veth[side]
            tbf = ["tbf", "rate", f"{int(rate_bit)}bit", "burst", str(burst), "limit", str(limit)] if rate_bit else []
            if impaired:
                netem = ["netem", "limit", "100000"]
                if delay_ms or jitter_ms:
                    netem += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
                if loss_pct:
                    netem += ["loss", f"{loss_pct}%"]
                self._exec(ns, tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
                if tbf:
                    self._exec(ns, tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
            elif tbf:
                self._exec(ns, tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        self.shaping = {"rate_bit": rate_bit, "delay_ms": delay_ms, "jitter_ms": jitter_ms, "loss_pct": loss_pct,
                        "burst_bytes": burst, "limit_bytes": limit}
        return self.shaping

    def clear_shaping(self) -> None:
        """Remove any qdisc this lab installed (back to the veth default)."""
        tc = _tc_tool() or "tc"
        for side in SIDES:
            self._exec(self.ns[side], tc, "qdisc", "del", "dev", self.veth[side], "root", check=False)
        self.shaping = None

    def qdiscs(self, side: str) -> str:
        """``tc -s qdisc show`` for one veth end (for diagnostics)."""
        s = self._side(side)
        return self._exec(self.ns[s], _tc_tool() or "tc", "-s", "qdisc", "show", "dev", self.veth[s]).stdout

    # ----------------------------------------------------------------- helpers
    def _side(self, ns: str) -> str:
        if ns in SIDES:
            return ns
        for side, name in self.ns.items():
            if ns == name:
                return side
        raise ValueError(f"unknown side {ns!r}: use one of {SIDES} or {tuple(self.ns.values())}")

    @staticmethod
    def _exec(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _sh([_ip_tool() or "ip", "netns", "exec", ns, *argv], check=check)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="print whether namespaces, tbf and netem work here")
    up = sub.add_parser("up", help="create the lab and leave it running (remove with 'down')")
    down = sub.add_parser("down", help="delete a lab (also after a crash)")
    for p in (up, down):
        p.add_argument("--prefix", default="prfaas-lab")
    up.add_argument("--subnet", default="10.203.0.0/30")
    up.add_argument("--rate-mbit", type=float, default=None, help="bandwidth each way, Mbit/s")
    up.add_argument("--delay-ms", type=float, default=0)
    up.add_argument("--jitter-ms", type=float, default=0)
    up.add_argument("--loss-pct", type=float, default=0)
    args = ap.parse_args(argv)

    if args.cmd == "check":
        ok, reason = netns_available()
        print(f"root:  {os.geteuid() == 0}")
        print(f"ip:    {_ip_tool() or 'missing'}")
        print(f"tc:    {_tc_tool() or 'missing'}")
        print(f"netns: {ok} ({reason})")
        print(f"tbf:   {tbf_available() if ok else False}")
        print(f"netem: {netem_available() if ok else False}"
              + ("" if ok and netem_available() else "  (delay/jitter/loss: use common.lab.link_proxy.LinkProxy)"))
        return 0 if ok else 1
    if args.cmd == "down":
        gone = cleanup(args.prefix)
        print("deleted: " + (", ".join(gone) if gone else "nothing"))
        return 0
    lab = TwoDatacenters(prefix=args.prefix, subnet=args.subnet).up()
    try:
        if args.rate_mbit or args.delay_ms or args.jitter_ms or args.loss_pct:
            rate = int(args.rate_mbit * 1e6) if args.rate_mbit else None
            print("shaping:", lab.shape(rate, args.delay_ms, args.jitter_ms, args.loss_pct))
    except BaseException:
        lab.down()
        raise
    for side in SIDES:
        print(f"{lab.ns[side]}: {lab.addr(side)} on {lab.veth[side]}  "
              f"(run: ip netns exec {lab.ns[side]} CMD)")
    print(f"remove with: python -m common.lab.netlab down --prefix {args.prefix}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NetlabError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
