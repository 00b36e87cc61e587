"""Worker flags that default from the environment (common/worker/flags.py)."""

import argparse

from common.worker.flags import add_prefill_flags


def _kv_stream() -> str:
    p = argparse.ArgumentParser()
    add_prefill_flags(p)
    return p.parse_args([]).kv_stream


def test_kv_stream_defaults_to_auto_and_follows_the_environment(monkeypatch):
    monkeypatch.delenv("PRFAAS_KV_STREAM", raising=False)
    assert _kv_stream() == "auto"
    monkeypatch.setenv("PRFAAS_KV_STREAM", "after")
    assert _kv_stream() == "after"
    p = argparse.ArgumentParser()
    add_prefill_flags(p)
    assert p.parse_args(["--kv-stream", "layer"]).kv_stream == "layer"  # the flag still wins
