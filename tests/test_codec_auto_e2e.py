"""``--kv-wire-codec auto`` on the running system: a planner (its short-loop codec ladder, told the
link's capacity with ``--link-gbps``), a decode worker and a PrfaaS prefill worker (tiny-dense) whose
KV link crosses a userspace proxy capped at that capacity. Idle, the link stays uncoded; once
transfers keep it busy the planner moves the link up the ladder (logged, on the planner's
``/metrics`` and in its status), the worker offers that codec in ``KV_BEGIN`` and the decode worker
admits it; when the load stops, the ladder steps back to ``none``. Lossy rungs only with
``--kv-wire-lossy-ok``.

(The link's own capacity estimate needs backlogged samples; on loopback the kernel's socket buffers
take a whole transfer of this size at once, so the sender is never backlogged and the configured
capacity is what the ladder compares with.)"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

from common.lab import overlap
from common.lab.cluster import free_port
from common.lab.overlap import Site, run_client
from common.lab.procs import stop
from common.rpc.client import RpcClient

PROMPT = 1200  # tokens: tiny-dense keeps 4 KiB of float32 K/V per token, ~4.9 MB per transfer
LINK_BPS = 8e6  # each transfer holds the link for ~5 s


def metric(port: int, name: str) -> dict[str, float]:
    """``{label text: value}`` of family ``name`` on a service's ``/metrics``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m.group(1) or "": float(m.group(2)) for m in re.finditer(rf"^{name}(?:{{(.*?)}})? (\S+)$", body, re.M)}


def planner_codecs(addr: str) -> dict:
    async def go():
        c = RpcClient(addr, service="test", name="test")
        try:
            return (await c.call("status", {}, timeout=5.0))["kv_codecs"]
        finally:
            await c.close()
    return asyncio.run(go())


def test_auto_codec_follows_the_link_and_lossy_needs_the_flag(monkeypatch):
    monkeypatch.setattr(overlap.netlab, "netns_available", lambda: (False, "the test runs on loopback"))
    monkeypatch.setenv("PRFAAS_PREFIX_CACHE", "0")  # every request is a whole prefill and a whole transfer
    monkeypatch.setenv("PRFAAS_THREADS", "1")
    p_metrics = free_port()
    with Site() as site:
        common = ["--model", "tiny-dense", "--planner", site.planner]
        [planner] = site.start("local", ["services.planner", "--listen", site.planner, "--loop-interval", "0.3",
                                       "--link-gbps", repr(LINK_BPS / 1e9), "--metrics-port", str(p_metrics)])
        site.start("local", ["services.decode", "--name", "decode-auto", "--listen", site.decode, "--kv-listen", site.kv,
                             "--kv-advertise", site.kv_public, *common])
        site.shape(LINK_BPS)

        addr = next(iter(site.prefill.values()))  # one prefill worker at a time

        def prefill(name: str, *flags: str):
            [p] = site.start("prfaas", ["services.prefill", "--name", name, "--cluster", "prfaas", "--listen", addr,
                                        *common, "--kv-wire-codec", "auto", "--report-interval", "0.2", *flags])
            return p

        pre = prefill("prefill-auto")
        time.sleep(2.0)  # idle link: reports flow, nothing changes
        assert planner_codecs(site.planner)["decisions"] == {}

        scarce = run_client(site, {"auto": addr}, PROMPT, 3)
        codecs = [r["kv_codec"] for r in scarce]
        assert codecs[0] == "none" and codecs[-1] == "lossless" and "fp8" not in codecs and "int4" not in codecs, codecs
        assert scarce[-1]["kv_wire_bytes"] < scarce[-1]["kv_bytes"]
        st = planner_codecs(site.planner)
        assert set(st["decisions"]) == {"lossless"}
        assert any(d["worker"] == "prefill-auto" and d["codec"] == "lossless" and "link busy" in d["reason"] for d in st["recent"])
        assert metric(p_metrics, "prfaas_planner_kv_codec_decisions_total") == {'codec="lossless"': st["decisions"]["lossless"]}
        # the load stops: plentiful again, the ladder steps back down
        end = time.monotonic() + 30
        while {d["codec"] for d in planner_codecs(site.planner)["links"] if d["worker"] == "prefill-auto"} != {"none"}:
            assert time.monotonic() < end, planner_codecs(site.planner)
            time.sleep(0.3)
        stop(pre)
        site.procs.remove(pre)

        # the same scarce link, a worker that allows lossy codecs: the ladder climbs past lossless
        pre = prefill("prefill-lossy", "--kv-wire-lossy-ok")
        lossy = run_client(site, {"lossy": addr}, PROMPT, 4)
        codecs = [r["kv_codec"] for r in lossy]
        assert codecs[0] == "none" and codecs[-1] in ("fp8", "int4"), codecs
        st = planner_codecs(site.planner)
        assert st["decisions"].get("fp8", 0) >= 1
        assert metric(p_metrics, "prfaas_planner_kv_codec_decisions_total")['codec="fp8"'] >= 1
        stop(pre)
        site.procs.remove(pre)
        stop(planner)
        site.procs.remove(planner)
        log = planner.stdout.read()
        assert re.search(r"KV codec prefill-auto -> \S+: lossless", log), log[-2000:]
        assert re.search(r"KV codec prefill-auto -> \S+: none \(demand would fill", log), log[-2000:]
        assert re.search(r"KV codec prefill-lossy -> \S+: fp8", log), log[-2000:]
