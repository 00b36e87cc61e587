"""Tests for the listening side of HELLO (common.rpc.handshake.HelloListener), without sockets:
the one accept path that RPC servers and KV receivers share, and the challenge that binds the
dialler's proof to the listener and to one connection."""

from __future__ import annotations

import msgpack
import pytest

from common.rpc.auth import answer_challenge, hello_auth
from common.rpc.credentials import Credentials
from common.rpc.handshake import HelloListener, hello_timeout_frame
from proto.frames import PREFIX, PREFIX_SIZE, ErrorCode, Kind, encode_frame

FP = {"model_id": "m", "dtype": "float32"}
SECRET = b"s3cret"


def decode(reply: bytes) -> tuple[Kind, dict]:
    """The kind and header of one encoded frame (no payload)."""
    _, _, kind, header_len, payload_len = PREFIX.unpack_from(reply, 0)
    assert payload_len == 0 and len(reply) == PREFIX_SIZE + header_len
    return Kind(kind), msgpack.unpackb(reply[PREFIX_SIZE:], raw=False)


def hello(name: str = "tx", service: str = "kv-sender", *, fingerprint=None, creds: Credentials | None = None) -> dict:
    h = {"service": service, "name": name}
    if fingerprint is not None:
        h["fingerprint"] = fingerprint
    if creds is not None:
        h["auth"] = hello_auth(creds)
    return h


def test_decode_helper_reads_what_encode_frame_wrote():
    assert decode(encode_frame(Kind.HELLO_OK, {"service": "s", "name": "n"})) == (Kind.HELLO_OK, {"service": "s", "name": "n"})


def test_challenge_then_auth_proves_both_sides():
    lis = HelloListener("kv-receiver", "rx", FP, SECRET, require_fingerprint=True)
    creds = Credentials("worker", master=SECRET)
    h = hello(fingerprint=dict(FP), creds=creds)
    ans = lis.answer(Kind.HELLO, h)
    assert (ans.accepted, ans.peer_name, ans.peer_service) == (True, "tx", "kv-sender")
    kind, ok = decode(ans.reply)
    assert kind is Kind.HELLO_OK and set(ok) == {"service", "name", "challenge", "mac"}
    proof = answer_challenge(creds, h["auth"], "tx", "kv-sender", ok)  # raises if the listener's mac is wrong
    assert lis.check_auth(ans.challenge, Kind.AUTH, proof, "tx") == ("worker", b"")


def test_auth_for_one_listener_is_refused_by_another():
    creds = Credentials("worker", master=SECRET)
    a, b = (HelloListener("kv-receiver", n, None, SECRET) for n in ("rx-a", "rx-b"))
    h = hello(creds=creds)
    ans_a, ans_b = a.answer(Kind.HELLO, h), b.answer(Kind.HELLO, dict(h))
    proof_a = answer_challenge(creds, h["auth"], "tx", "kv-sender", decode(ans_a.reply)[1])
    role, refusal = b.check_auth(ans_b.challenge, Kind.AUTH, proof_a, "tx")
    assert role is None and decode(refusal)[1]["code"] == ErrorCode.AUTH_FAILED.value


def test_wrong_secret_is_caught_by_the_dialler_at_hello_ok():
    lis = HelloListener("router", "r0", None, SECRET)
    creds = Credentials("gateway", master=b"wrong")
    h = hello("gw", "gateway", creds=creds)
    with pytest.raises(PermissionError, match="did not prove"):
        answer_challenge(creds, h["auth"], "gw", "gateway", decode(lis.answer(Kind.HELLO, h).reply)[1])


def test_role_without_a_key_is_refused_at_hello():
    """A credentials file holds only its role's pair keys: a worker's accepts no router (routers never
    dial workers), the gateway's cannot speak as the planner or the operator, a worker's not as the operator
    towards the planner."""
    from common.rpc.credentials import keys_for
    worker = Credentials("worker", keys=keys_for(SECRET, "worker"))
    gw = Credentials("gateway", keys=keys_for(SECRET, "gateway"))
    lis = HelloListener("pd", "pd-0", None, worker)
    forged = {"service": "router", "name": "r", "auth": {"role": "router", "nonce": "0" * 32}}
    kind, err = decode(lis.answer(Kind.HELLO, forged).reply)
    assert (kind, err["code"]) == (Kind.ERROR, ErrorCode.AUTH_FAILED.value) and "may not connect" in err["message"]
    assert gw.key("planner", "worker") is None and gw.key("operator", "planner") is None
    assert worker.key("operator", "planner") is None  # no worker can call move_worker


@pytest.mark.parametrize("auth", [None, {"ts": float("inf"), "nonce": "x", "mac": "y"}, {"role": 5, "nonce": "0" * 32},
                                  {"role": "worker", "nonce": float("nan")}, "junk"])
def test_malformed_auth_is_auth_failed_never_an_exception(auth):
    h = {"service": "kv-sender", "name": "tx", **({"auth": auth} if auth is not None else {})}
    kind, err = decode(HelloListener("svc", "srv", None, SECRET).answer(Kind.HELLO, h).reply)
    assert (kind, err["code"]) == (Kind.ERROR, ErrorCode.AUTH_FAILED.value)


def test_accepts_without_secret_and_sends_no_challenge():
    ans = HelloListener("router", "r0", None, None).answer(Kind.HELLO, hello(service="gateway", name="gw"))
    assert ans.accepted and ans.challenge is None
    assert decode(ans.reply) == (Kind.HELLO_OK, {"service": "router", "name": "r0"})


def test_first_frame_not_hello_is_bad_frame():
    ans = HelloListener("router", "r0", None, None).answer(Kind.PING, {"t": 1.0})
    assert (ans.accepted, ans.peer_name, ans.peer_service) == (False, "?", "?")
    assert decode(ans.reply) == (Kind.ERROR, {"code": ErrorCode.BAD_FRAME.value, "message": "expected HELLO, got PING"})


@pytest.mark.parametrize("field", [{"name": 7}, {"service": ["x"]}, {"name": "n" * 1000}])
def test_name_and_service_must_be_short_strings(field):
    ans = HelloListener("router", "r0", None, None).answer(Kind.HELLO, {**hello(), **field})
    assert not ans.accepted and decode(ans.reply)[1]["code"] == ErrorCode.BAD_REQUEST.value


def test_fingerprint_not_a_map_is_bad_request():
    ans = HelloListener("kv-receiver", "rx", FP, None, require_fingerprint=True).answer(Kind.HELLO, hello(fingerprint=[1]))
    assert not ans.accepted
    assert decode(ans.reply) == (Kind.ERROR, {"code": ErrorCode.BAD_REQUEST.value, "message": "fingerprint must be a map"})


def test_fingerprint_mismatch_names_the_field():
    ans = HelloListener("kv-receiver", "rx", FP, None).answer(Kind.HELLO, hello(fingerprint={**FP, "dtype": "bfloat16"}))
    assert not ans.accepted and ans.peer_name == "tx"
    assert decode(ans.reply) == (Kind.ERROR, {
        "code": ErrorCode.FINGERPRINT_MISMATCH.value,
        "message": "rx refused the peer: fingerprint field 'dtype' differs: ours='float32' theirs='bfloat16'"})


@pytest.mark.parametrize("require,accepted", [(True, False), (False, True)])
def test_missing_fingerprint_refused_only_when_required(require, accepted):
    ans = HelloListener("kv-receiver", "rx", FP, None, require_fingerprint=require).answer(Kind.HELLO, hello())
    assert ans.accepted is accepted
    if not accepted:
        assert decode(ans.reply) == (Kind.ERROR, {"code": ErrorCode.FINGERPRINT_MISMATCH.value,
                                                  "message": "rx refused the peer: the peer sent no fingerprint"})


def test_listener_without_fingerprint_accepts_any():
    ans = HelloListener("kv-receiver", "rx", None, None, require_fingerprint=True).answer(Kind.HELLO, hello(fingerprint=FP))
    assert ans.accepted


def test_auth_is_checked_before_the_fingerprint():
    """An unauthenticated peer learns nothing of our fingerprint: auth_failed, not fingerprint_mismatch."""
    lis = HelloListener("kv-receiver", "rx", FP, SECRET, require_fingerprint=True)
    ans = lis.answer(Kind.HELLO, hello(fingerprint={**FP, "dtype": "x"}))
    kind, h = decode(ans.reply)
    assert (ans.accepted, kind, h["code"]) == (False, Kind.ERROR, ErrorCode.AUTH_FAILED.value)
    assert "float32" not in h["message"]


def test_timeout_frame():
    assert decode(hello_timeout_frame()) == (Kind.ERROR, {"code": ErrorCode.TIMEOUT.value,
                                                          "message": "no HELLO within the handshake timeout"})
