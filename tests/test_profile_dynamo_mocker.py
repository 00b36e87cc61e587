"""The ``dynamo_mocker`` emulated profile gives Dynamo's mocker's numbers (its default polynomial
timing model, see services/planner/profiles/dynamo_mocker.json), and a decode polynomial may have
negative coefficients (the mocker's ``p**2`` term) while other fields may not."""

import pytest

from common.model.emulated import EmulatedProfile, ProfileError


def mocker_prefill_ms(t: float) -> float:
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142


def mocker_decode_ms(p: float) -> float:
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


CAPACITY = 16384 * 64


@pytest.fixture(scope="module")
def profile() -> EmulatedProfile:
    return EmulatedProfile.from_file("dynamo_mocker")


@pytest.mark.parametrize("tokens", [1, 1011, 1024, 8192, 32768])
def test_prefill_is_the_mocker_polynomial(profile, tokens):
    assert profile.t_prefill(tokens) * 1e3 == pytest.approx(mocker_prefill_ms(tokens), rel=1e-9)


def test_prefill_of_the_notes_prompt(profile):
    assert profile.t_prefill(1011) * 1e3 == pytest.approx(32.28, abs=0.01)  # "the model says 32 ms"


@pytest.mark.parametrize("rows,context", [(1, 0), (1, 1124), (8, 8 * 1124), (256, CAPACITY // 2), (1, CAPACITY)])
def test_decode_step_is_the_mocker_polynomial_at_any_batch(profile, rows, context):
    assert profile.t_step(rows, context) * 1e3 == pytest.approx(mocker_decode_ms(context / CAPACITY), rel=1e-9)


def test_decode_step_floor(profile):
    assert profile.t_step(1, 3 * CAPACITY) == pytest.approx(0.001)  # the polynomial is negative there
    assert profile.bs_max == 256


def test_kv_bytes_are_the_mocker_models(profile):
    assert profile.kv_affine() == (0.0, 32 * 2 * 8 * 128 * 2)
    assert profile.s_kv(1024) == 1024 * 131072


def test_only_the_decode_polynomial_may_be_negative():
    base = {"prefill_poly_s": [0.01, 1e-5], "kv_bytes_per_token": 1,
            "decode": {"bs_max": 1, "kv_frac_poly_s": [0.005, 0.05, -0.02], "kv_capacity_tokens": 100}}
    EmulatedProfile.from_dict(base)
    with pytest.raises(ProfileError, match="prefill_poly_s"):
        EmulatedProfile.from_dict(dict(base, prefill_poly_s=[0.01, -1e-5]))
