"""The emulated backend (common/model/emulated.py): profiles, scales, the token rule, and the
backend's calls and waits on a fake clock. No sockets; the whole-system check is test_emulated_cluster.py."""

from __future__ import annotations

import math

import pytest

from common.kv.paged_store import PagedKvStore
from common.model.backend import PrefillCancelled, make_backend
from common.model.emulated import (
    EmulatedBackend,
    EmulatedModel,
    EmulatedProfile,
    ProfileError,
    Scales,
    expected_tokens,
    next_token,
)
from services.planner import throughput as tm


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def backend(scales: Scales | None = None, profile: str = "h20_table6_fit") -> tuple[EmulatedBackend, FakeClock]:
    fc = FakeClock()
    return EmulatedBackend(EmulatedProfile.from_file(profile), scales or Scales(time_scale=10, token_scale=32, byte_scale=1e-4),
                           sleep=fc.sleep, clock=fc.clock), fc


def test_tokens_depend_only_on_the_previous_token_and_position():
    prompt = [5, 9, 200, 31]
    out = expected_tokens(prompt, 20)
    assert all(97 <= t <= 122 for t in out)
    assert out[0] == next_token(31, 4) and out[5] == next_token(out[4], 9)
    # a resumed stream (prompt + what was streamed) continues with the same tokens
    assert expected_tokens(prompt + out[:7], 13) == out[7:]
    assert len(set(out)) > 5


def test_profiles_ship_with_units_and_the_kv_fit_holds_the_table():
    h200, h20 = EmulatedProfile.from_file("h200_table5"), EmulatedProfile.from_file("h20_table6_fit")
    assert h200.kv_affine() == h20.kv_affine()  # one model on both sides: the same KV layout
    f, p = h200.kv_affine()
    for l, kv in zip(h200.lengths, h200.kv_bytes):
        assert abs((f + p * l) / kv - 1) < 0.01
    assert h20.t_decode() == pytest.approx(0.0225) and h20.bs_max == 18
    assert h20.bs_max / h20.t_decode() == pytest.approx(800.0)  # tokens/s per instance, read off Table 6
    with pytest.raises(ProfileError):
        h200.t_step(1, 0)  # a prefill-only instance


@pytest.mark.parametrize("bad, field", [
    ({"prefill_s": [1.0]}, "prefill"), ({"lengths": [2, 1], "prefill_s": [1, 2], "kv_bytes": [1, 2]}, "increasing"),
    ({"lengths": [1, 2], "prefill_s": [1, -2], "kv_bytes": [1, 2]}, "prefill_s"),
    ({"lengths": [1, 2], "prefill_s": [1, 2], "kv_bytes": [1, 2], "decode": {"batch": [1], "step_s": [1, 2], "bs_max": 4}}, "batch"),
])
def test_bad_profiles_are_refused_naming_the_field(bad, field):
    with pytest.raises(ProfileError, match=field):
        EmulatedProfile.from_dict(bad)


def test_mocker_style_profile_polynomials():
    p = EmulatedProfile.from_dict({"prefill_poly_s": [0.0165, 1.5e-5, 4.2e-10], "kv_bytes_per_token": 1000,
                                   "decode": {"bs_max": 64, "kv_frac_poly_s": [0.00574, 0.05401, -0.02574],
                                              "kv_capacity_tokens": 1000, "min_step_s": 0.001}})
    assert p.t_prefill(1000) == pytest.approx(0.0165 + 0.015 + 4.2e-4)
    assert p.t_step(3, 500) == pytest.approx(0.00574 + 0.05401 * 0.5 - 0.02574 * 0.25)


def test_scaled_profiles_give_the_planner_the_same_model_times_s():
    """Every rate of eqs. 3-8 scales by time_scale and the threshold by 1/token_scale."""
    h200, h20 = EmulatedProfile.from_file("h200_table5"), EmulatedProfile.from_file("h20_table6_fit")
    dist = tm.TruncatedLogNormal(9.9, 1.0, 128, 131072)
    sols = []
    for sc in (Scales(time_scale=1, token_scale=1, byte_scale=1.0), Scales(time_scale=5, token_scale=32, byte_scale=1.5e-4)):
        k = sc.token_scale
        model = EmulatedModel(h20, sc)
        dep = tm.Deployment(4, 3, 5, tm.HardwareProfile.from_dict(h200.throughput_profile(sc)),
                            tm.HardwareProfile.from_dict(h20.throughput_profile(sc)),
                            tm.HardwareProfile.from_dict(h20.throughput_profile(sc)),
                            100.0 * model.byte_scale * sc.time_scale, 1024 / 64 if k > 1 else 1024)
        sc_dist = tm.TruncatedLogNormal(dist.mu - math.log(k), dist.sigma, dist.lo / k, dist.hi / k)
        ev = tm.best_threshold(dep, sc_dist)
        sols.append((ev.lambda_max / sc.time_scale, ev.t * k, ev.p))
    (l1, t1, p1), (l2, t2, p2) = sols
    assert l2 == pytest.approx(l1, rel=0.02) and t2 == pytest.approx(t1, rel=0.05) and p2 == pytest.approx(p1, abs=0.02)


def test_prefill_waits_its_profiled_time_in_layer_slices_and_emits_the_layout():
    b, fc = backend()
    n = 100
    calls = []
    logits = b.prefill(list(range(n)), lambda i, st, sf: calls.append((i, {k: tuple(t.shape) for k, t in st.items()}, sf, fc.now)))
    want = b.profile.t_prefill(n * 32) / 10
    assert fc.now - 100.0 == pytest.approx(want)
    assert [c[0] for c in calls] == list(range(8))
    assert all(c[2] is None for c in calls)
    lay = b.layer_layouts(n)
    for i, shapes, _, _ in calls:
        assert shapes == {t["name"]: tuple(t["shape"]) for t in lay[i]["tensors"]}
    assert [c[3] - 100.0 for c in calls] == pytest.approx([want * (i + 1) / 8 for i in range(8)])
    assert int(logits.argmax()) == next_token(n - 1, n)
    assert b.kv_bytes(n) == b.model.wire_bytes(n)
    # KV bytes follow the profile x byte_scale (within the rounding to whole fp16 elements)
    assert b.kv_bytes(n) / (b.profile.s_kv(n * 32) * 1e-4) == pytest.approx(1.0, rel=0.1)


def test_chunked_prefill_with_a_prefix_reports_chunks_and_checkpoints():
    b, fc = backend()
    calls, marks = [], []
    def on_layer(i, st, sf):
        calls.append((i, sf, st["k"].shape[-2] if "k" in st else None))

    b.prefill(list(range(64)), on_layer, chunk_tokens=16, prefix=[{}] * 8, prefix_len=16, checkpoints=[32, 64],
              on_checkpoint=lambda p, s: marks.append((p, sorted(s))))
    assert fc.now - 100.0 == pytest.approx(b.profile.t_prefill(48 * 32) / 10)
    attn = [c for c in calls if b.model.layer_types[c[0]] == "attention"]
    assert [(c[1], c[2]) for c in attn] == [(16, 32), (16, 32), (32, 48), (32, 48), (48, 64), (48, 64)]
    assert [m[0] for m in marks] == [32, 64] and marks[0][1] == [i for i, k in enumerate(b.model.layer_types) if k == "linear"]
    with pytest.raises(PrefillCancelled):
        b.prefill([1, 2, 3], lambda *a: None, should_stop=lambda: True)


def test_decode_step_waits_the_step_time_at_the_live_batch_and_grows_rows():
    sc = Scales(time_scale=10, token_scale=32, byte_scale=1e-4, output_scale=4)
    b, fc = backend(sc)
    store = b.paged_store(1 << 20, 16)
    assert isinstance(store, PagedKvStore)
    seqs = [store.reserve(f"r{i}", 20 + i) for i in range(3)]
    for s, n in zip(seqs, (19, 20, 21)):
        s.length = n
    logits = b.paged_step(store, seqs, [7, 8, 9])
    ctx = (19 + 20 + 21) * 32
    assert fc.now - 100.0 == pytest.approx(b.profile.t_step(3, ctx) * 4 / 10)
    assert logits.argmax(1).tolist() == [next_token(7, 20), next_token(8, 21), next_token(9, 22)]
    assert [s.length for s in seqs] == [20, 21, 22]
    # host work between back-to-back steps is part of the next step's period, not added to it
    end1 = fc.now
    fc.now += 0.001
    b.paged_step(store, seqs, [1, 2, 3])
    assert fc.now - end1 == pytest.approx(b.profile.t_step(3, ctx + 3 * 32) * 4 / 10)
    fc.now += 10.0  # an idle loop: the next step waits its whole time
    t_idle = fc.now
    waited = []
    b.paged_step(store, seqs[:1], [1], wait_layer=waited.append)
    assert waited == list(range(8)) and fc.now - t_idle == pytest.approx(b.profile.t_step(1, 22 * 32) * 4 / 10)


def test_registry_builds_the_emulated_backend_by_name(monkeypatch):
    monkeypatch.setenv("PRFAAS_EMU_TIME_SCALE", "4")
    b = make_backend("emulated", None, profile="h200_table5")
    assert isinstance(b, EmulatedBackend) and b.scales.time_scale == 4 and b.loaded.max_model_len >= 1 << 17
    with pytest.raises(ProfileError):
        Scales(time_scale=0)
