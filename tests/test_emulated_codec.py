"""A KV wire codec modelled on the emulated backend (common/model/emulated_codec.py): the pipelined
encode hand-off, the coded layout and its scales, the waits on a fake clock, and the emulated
cluster's use of it (pools, environment). No sockets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.lab.codec_cluster import DENSE_KV_BYTES_PER_TOKEN, dense_profiles, model_point
from common.lab.emulated_cluster import PAPER_SHAPES, EmulatedCluster
from common.model.emulated import EmulatedBackend, EmulatedModel, EmulatedProfile, Scales
from common.model.emulated_codec import ENV_ENCODE_GBPS, EncodeModel, handoff_s

SC = Scales(time_scale=5, token_scale=32, byte_scale=1.5e-4, output_scale=64)


def test_handoff_is_compute_plus_one_layer_when_encode_is_fast_and_encode_paced_when_slow():
    # no encoder: the hand-off is the compute itself
    assert handoff_s(0.5, 2.0, 0.0, 10) == pytest.approx(1.0)
    # fast encoder (1 s over 10 layers against 2 s of compute): one layer's encode after each layer's compute
    assert handoff_s(0.5, 2.0, 1.0, 10) == pytest.approx(1.0 + 0.1)
    assert handoff_s(1.0, 2.0, 1.0, 10) == pytest.approx(2.0 + 0.1)
    # slow encoder (4 s): the first layer after its compute, then one encode per layer
    assert handoff_s(1.0, 2.0, 4.0, 10) == pytest.approx(0.2 + 0.4 * 10)
    assert handoff_s(0.1, 2.0, 4.0, 10) == pytest.approx(0.2 + 0.4)
    # never earlier than the compute, monotone in the share of layers
    xs = [handoff_s(f / 20, 3.0, 1.5, 94) for f in range(1, 21)]
    assert xs == sorted(xs) and all(x >= f / 20 * 3.0 for f, x in zip(range(1, 21), xs))
    with pytest.raises(ValueError):
        EncodeModel(0.0)


def test_encode_model_from_env_and_seconds(monkeypatch):
    monkeypatch.delenv(ENV_ENCODE_GBPS, raising=False)
    assert EncodeModel.from_env() is None
    monkeypatch.setenv(ENV_ENCODE_GBPS, "40")
    m = EncodeModel.from_env()
    assert m.gbps == 40 and m.encode_seconds(5e9, 5.0) == pytest.approx(5e9 * 8 / 40e9 / 5)
    assert EncodeModel().encode_seconds(1e12, 1.0) == 0.0


def test_coded_layout_shrinks_k_v_but_not_the_scales_or_the_states(tmp_path: Path):
    prfaas, pd = dense_profiles(tmp_path)
    p = EmulatedProfile.from_file(prfaas)
    assert p.kv_affine() == (0.0, float(DENSE_KV_BYTES_PER_TOKEN))
    assert EmulatedProfile.from_file(pd).kv_affine()[1] == DENSE_KV_BYTES_PER_TOKEN
    raw, coded = EmulatedModel(p, SC), EmulatedModel(p, Scales(**{**SC.__dict__, "kv_ratio": 1.97}))
    assert raw.kv_ratio == 1.0 and coded.kv_ratio == pytest.approx(1.97, rel=0.02)
    assert coded.byte_scale == raw.byte_scale  # the link is scaled by the raw bytes
    assert coded.per_token_bytes * coded.kv_ratio == pytest.approx(raw.per_token_bytes)
    assert coded.fixed_bytes == raw.fixed_bytes and coded.weight_hash() != raw.weight_hash()
    # the planner's scaled profile carries the coded size
    kv_raw = p.throughput_profile(SC)["kv_bytes"]
    kv_coded = p.throughput_profile(Scales(**{**SC.__dict__, "kv_ratio": 1.97}))["kv_bytes"]
    assert [a / b for a, b in zip(kv_raw, kv_coded)] == pytest.approx([coded.kv_ratio] * len(kv_raw), rel=0.01)
    with pytest.raises(ValueError):
        Scales(kv_ratio=0)


def test_kv_ratio_travels_in_the_environment(monkeypatch):
    sc = Scales(**{**SC.__dict__, "kv_ratio": 3.2})
    for k, v in sc.env().items():
        monkeypatch.setenv(k, v)
    assert Scales.from_env() == sc and "coded /3.2" in sc.describe()


def test_prefill_waits_for_the_modelled_encoder(tmp_path: Path):
    prfaas, _ = dense_profiles(tmp_path)
    prof = EmulatedProfile.from_file(prfaas)

    def run(encode):
        now = [0.0]
        calls = []
        b = EmulatedBackend(prof, SC, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0], encode=encode)
        b.prefill(list(range(1000)), lambda i, st, sf: calls.append((i, now[0])))
        return b, calls, now[0]

    b, calls0, t_free = run(None)
    compute = b.prefill_seconds(1000)
    assert t_free == pytest.approx(compute)
    slow = EncodeModel(gbps=1.0, layers=10)
    enc = slow.encode_seconds(DENSE_KV_BYTES_PER_TOKEN * 1000 * 32, SC.time_scale)
    assert enc > compute  # this encoder is slower than the compute: it paces the hand-off
    _, calls1, t_slow = run(slow)
    attn = [i for i, k in enumerate(b.model.layer_types) if k == "attention"]
    last = attn[-1]
    assert dict(calls1)[last] == pytest.approx(handoff_s((last + 1) / len(b.model.layer_types), compute, enc, 10))
    assert t_slow == pytest.approx(max(compute, dict(calls1)[last]))
    # linear layers are not held back by the encoder (states are not modelled as coded)
    assert dict(calls1)[0] == pytest.approx(dict(calls0)[0])


def test_cluster_shrinks_pools_by_the_ratio_and_gives_the_encoder_to_prfaas_only(tmp_path: Path):
    prfaas, pd = dense_profiles(tmp_path)
    c = EmulatedCluster(PAPER_SHAPES["prfaas"], Scales(**{**SC.__dict__, "kv_ratio": 2.0}), prfaas_profile=prfaas, pd_profile=pd,
                        encode_gbps=64.0, log_dir=tmp_path)
    for k in ("planner", "router", "gateway", "planner:remote", "router:remote"):
        c.addrs[k] = "127.0.0.1:1"
    for k in range(4):
        c.addrs[f"prfaas-{k}"] = c.addrs[f"rpc:prfaas-{k}"] = "127.0.0.1:1"
    for k in range(8):
        c.addrs[f"pd-{k}"] = c.addrs[f"pd-{k}:kv"] = c.addrs[f"kv:pd-{k}"] = "127.0.0.1:1"
    host = c.commands()["host-pd"]
    budget = host[host.index("--kv-budget-bytes") + 1]
    assert int(budget) == round(c.decode_pool_bytes / c.model.kv_ratio) and c.model.kv_ratio == pytest.approx(2.0, rel=0.02)
    assert c.env_for("host-prfaas", {"A": "1"}) == {"A": "1", ENV_ENCODE_GBPS: "64.0"}
    assert c.env_for("host-pd", {"A": "1"}) == {"A": "1"}
    # the model's optimum without a codec fills the link (bandwidth-bound); a codec raises it
    none, fp8 = model_point(prfaas, pd, 1.0), model_point(prfaas, pd, 1.97)
    assert none.egress_gbps == pytest.approx(20.0, rel=1e-3) and fp8.lambda_max > 1.3 * none.lambda_max
    assert math.isfinite(none.t)
