"""The measured gain of the KV wire codecs (``scripts/bench_codec.py``): TTFT and wire bytes of a long
remote prompt over a 100 Mbit/s link per codec.

TTFT: a PrfaaS prefill worker and a decode worker joined by a rate-capped link (two namespaces with
``tc`` tbf when root has them, else the userspace proxy of :mod:`common.lab.overlap`); the prefill
worker is restarted with each ``--kv-wire-codec`` and the same prompts are served (prefix caches off,
so every request is a full prefill and a full transfer). TTFT is measured by a client beside the decode
worker; the wire bytes are the sender's count for that transfer.
"""

from __future__ import annotations

import os
import statistics


def ttft_per_codec(model: str, codecs: list[str], prompt_len: int, reps: int, rate_bps: float = 100e6) -> dict[str, dict]:
    """``{codec: {ttft_s, kv_bytes, kv_wire_bytes, prefill_s}}`` (medians over ``reps``) on a link of ``rate_bps``."""
    from common.lab.overlap import Site, run_client
    from common.lab.procs import stop

    os.environ.setdefault("PRFAAS_THREADS", "1")
    os.environ["PRFAAS_PREFIX_CACHE"] = "0"
    # the lab's namespaces bind non-loopback addresses on a private veth pair only reachable from here
    os.environ.setdefault("PRFAAS_INSECURE", "1")
    out: dict[str, dict] = {}
    with Site() as site:
        common = ["--model", model, "--planner", site.planner]
        site.start("local", ["services.planner", "--listen", site.planner])
        site.start("local", ["services.decode", "--name", "decode-codec", "--listen", site.decode, "--kv-listen", site.kv,
                             "--kv-advertise", site.kv_public, *common])
        site.shape(rate_bps)
        addr = next(iter(site.prefill.values()))  # one worker at a time, restarted per codec
        for codec in codecs:
            [pre] = site.start("prfaas", ["services.prefill", "--name", f"prefill-{codec}", "--cluster", "prfaas", "--listen",
                                          addr, *common, "--kv-wire-codec", codec, "--kv-wire-lossy-ok"])
            rs = run_client(site, {codec: addr}, prompt_len, reps)
            out[codec] = {k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "kv_bytes", "kv_wire_bytes", "prefill_s")}
            out[codec]["codec_seen"] = rs[-1]["kv_codec"]
            stop(pre)
            site.procs.remove(pre)
    return out
