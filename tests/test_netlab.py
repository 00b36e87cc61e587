"""The two-datacenter lab (common/lab/netlab.py): connectivity, tbf bandwidth shaping, teardown.

Needs root and working network namespaces; otherwise every test is skipped with the reason. All
traffic stays inside the lab's two namespaces (a private /30 that exists only there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from common.lab import netlab
from common.lab.netlab import NetemUnavailable, TwoDatacenters

_OK, _REASON = netlab.netns_available()
pytestmark = [
    pytest.mark.skipif(not _OK, reason=f"netlab needs root and network namespaces: {_REASON}"),
    pytest.mark.timeout(60),
]

PORT = 5599

# Echo server: serves connections one after another, echoing each until EOF, forever. argv: host port
ECHO_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
while True:
    c, _ = s.accept()
    while True:
        b = c.recv(65536)
        if not b:
            break
        c.sendall(b)
    c.close()
"""

ECHO_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
msg = b"hello across datacenters"
c.sendall(msg); got = b""
while len(got) < len(msg):
    got += c.recv(65536)
print(got.decode(), flush=True)
"""

# Bulk sink: receives N bytes, then acks with one byte and prints the count. argv: host port N
SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); want = int(sys.argv[3]); n = 0
while n < want:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
c.sendall(b"k"); print(n, flush=True)
"""

# Bulk source: sends N bytes, waits for the sink's ack, prints elapsed seconds (connect to ack).
SOURCE = r"""
import socket, sys, time
want = int(sys.argv[3]); buf = b"\x5a" * (1 << 20)
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
sent = 0
while sent < want:
    k = min(len(buf), want - sent); c.sendall(buf[:k]); sent += k
assert c.recv(1) == b"k"
print(time.monotonic() - t0, flush=True)
"""


def _prefix() -> str:
    return f"nltest-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def _our_namespaces(prefix: str) -> list[str]:
    return [ns for ns in netlab.list_namespaces() if ns.startswith(prefix)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_server(lab: TwoDatacenters, side: str, script: str, *args: str) -> subprocess.Popen:
    srv = lab.run(side, [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    line = srv.stdout.readline().strip()
    assert line == "ready", f"server did not start: {line!r}"
    return srv


def test_echo_across_link_and_teardown():
    prefix = _prefix()
    with TwoDatacenters(prefix=prefix, subnet="10.203.7.0/30") as lab:
        assert sorted(_our_namespaces(prefix)) == sorted([f"{prefix}-prfaas", f"{prefix}-local"])
        assert (lab.addr("prfaas"), lab.addr("local")) == ("10.203.7.1", "10.203.7.2")
        srv = _start_server(lab, "local", ECHO_SERVER, lab.addr("local"), str(PORT))
        cli = lab.run("prfaas", [sys.executable, "-c", ECHO_CLIENT, lab.addr("local"), str(PORT)],
                      stdout=subprocess.PIPE, text=True)
        out, _ = cli.communicate(timeout=15)
        assert cli.returncode == 0
        assert out.strip() == "hello across datacenters"
        # lo is up on both sides; the host's network is not reachable (only lo and the veth exist).
        links = lab.exec("local", ["ip", "-o", "link", "show"]).stdout
        assert "lo" in links and "veth-local" in links and len(links.strip().splitlines()) == 2
        assert srv.poll() is None  # still serving until teardown
    assert _our_namespaces(prefix) == []
    assert srv.poll() is not None  # killed (or finished) by teardown


def test_bulk_transfer_at_100mbit():
    """~25 MB through a 100 Mbit/s tbf: goodput (payload bytes / connect-to-ack time) within 85-105 %."""
    prefix = _prefix()
    rate = 100_000_000
    size = 25_000_000
    with TwoDatacenters(prefix=prefix, subnet="10.203.8.0/30") as lab:
        shaping = lab.shape(rate_bit=rate)
        assert shaping["burst_bytes"] == 128 * 1024 and shaping["limit_bytes"] == 512 * 1024
        assert "tbf" in lab.qdiscs("prfaas") and "tbf" in lab.qdiscs("local")
        sink = _start_server(lab, "local", SINK, lab.addr("local"), str(PORT), str(size))
        src = lab.run("prfaas", [sys.executable, "-c", SOURCE, lab.addr("local"), str(PORT), str(size)],
                      stdout=subprocess.PIPE, text=True)
        out, _ = src.communicate(timeout=30)
        assert src.returncode == 0, out
        elapsed = float(out.strip())
        assert int(sink.stdout.readline()) == size
        goodput = size * 8 / elapsed
        print(f"goodput {goodput / 1e6:.1f} Mbit/s ({goodput / rate:.1%} of {rate / 1e6:.0f} Mbit/s), "
              f"{elapsed:.2f} s for {size / 1e6:.0f} MB")
        assert 0.85 * rate <= goodput <= 1.05 * rate, f"goodput {goodput / 1e6:.1f} Mbit/s"
        lab.clear_shaping()
        assert "tbf" not in lab.qdiscs("prfaas")
    assert _our_namespaces(prefix) == []


def test_teardown_after_failure_is_idempotent_and_kills_processes():
    prefix = _prefix()
    lab = TwoDatacenters(prefix=prefix, subnet="10.203.9.0/30")
    with pytest.raises(RuntimeError, match="boom"):
        with lab:
            sleeper = lab.run("local", ["sleep", "300"])
            # A process started behind the lab's back (not via run) is killed too.
            stray = int(lab.exec("prfaas", ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]).stdout)
            raise RuntimeError("boom")
    assert _our_namespaces(prefix) == []
    assert sleeper.poll() is not None
    assert not _alive(stray)
    lab.down()  # second teardown is harmless
    assert _our_namespaces(prefix) == []


def test_cleanup_removes_leftovers_from_a_crashed_run():
    prefix = _prefix()
    lab = TwoDatacenters(prefix=prefix, subnet="10.203.10.0/30").up()
    try:
        lab.run("prfaas", ["sleep", "300"])
        # A second lab with the same prefix refuses to clobber the existing one.
        with pytest.raises(netlab.NetlabError, match="already exists"):
            TwoDatacenters(prefix=prefix, subnet="10.203.10.0/30").up()
        assert len(_our_namespaces(prefix)) == 2  # the refused lab did not delete ours
        # "Crash": forget the object, clean up by prefix as `netlab.py down` would.
        assert sorted(netlab.cleanup(prefix)) == sorted([f"{prefix}-prfaas", f"{prefix}-local"])
        assert _our_namespaces(prefix) == []
        assert netlab.cleanup(prefix) == []
    finally:
        lab.down()
    assert _our_namespaces(prefix) == []


def test_delay_without_netem_is_a_clear_error():
    if netlab.netem_available():
        pytest.skip("netem is available here; delay is applied in the kernel")
    prefix = _prefix()
    with TwoDatacenters(prefix=prefix, subnet="10.203.11.0/30") as lab:
        with pytest.raises(NetemUnavailable, match="LinkProxy"):
            lab.shape(rate_bit=100_000_000, delay_ms=20)
        assert lab.needs_userspace_proxy == ["delay_ms"]
    assert _our_namespaces(prefix) == []


def test_cli_check_runs():
    p = subprocess.run([sys.executable, "-m", "common.lab.netlab", "check"], capture_output=True, text=True,
                       cwd=os.path.join(os.path.dirname(__file__), ".."), timeout=30)
    assert p.returncode == 0, p.stderr
    assert "netns: True" in p.stdout and "netem:" in p.stdout


def test_exec_prefix_runs_the_command_in_place_inside_the_namespace():
    """Launchers that start services themselves (common/lab/cluster.py ``wrap``) get the namespace's argv
    prefix; ``ip netns exec`` execs in place, so the Popen pid is the service's own (SIGKILL hits it)."""
    prefix = _prefix()
    with TwoDatacenters(prefix=prefix, subnet="10.203.12.0/30") as lab:
        script = "import os; print(os.getpid(), 'veth-prfaas' in open('/proc/net/dev').read(), flush=True)"
        p = subprocess.Popen([*lab.exec_prefix("prfaas"), sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=15)
        assert out.split() == [str(p.pid), "True"]
    assert _our_namespaces(prefix) == []


def test_run_in_lab_tears_everything_down_after_a_failing_command():
    """common/lab/topology.run_in_lab: the command runs in the local namespace and finds the lab;
    when it fails, its exit status comes back and both namespaces, with what ran in them, are gone."""
    from common.lab.topology import LAB_ENV, run_in_lab

    prefix = _prefix()
    script = (f"import os, subprocess, sys; assert os.environ['{LAB_ENV}'].split()[0] == '{prefix}'; "
              "assert 'veth-local' in open('/proc/net/dev').read(); "
              f"p = subprocess.Popen(['ip', 'netns', 'exec', '{prefix}-prfaas', 'sleep', '300']); "
              "open(sys.argv[1], 'w').write(str(p.pid)); sys.exit(3)")
    pidfile = f"/tmp/{prefix}.pid"
    try:
        assert run_in_lab([sys.executable, "-c", script, pidfile], prefix=prefix, subnet="10.203.13.0/30") == 3
        with open(pidfile) as f:
            sleeper = int(f.read())
    finally:
        if os.path.exists(pidfile):
            os.unlink(pidfile)
    assert _our_namespaces(prefix) == []
    assert not _alive(sleeper)
