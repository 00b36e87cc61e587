"""Tests for the listening side of HELLO (common.rpc.handshake.HelloListener), without sockets:
the one accept path that RPC servers and KV receivers share."""

from __future__ import annotations

import msgpack
import pytest

from common.rpc.auth import hello_auth, reply_mac
from common.rpc.handshake import HelloListener, hello_timeout_frame
from proto.frames import PREFIX, PREFIX_SIZE, ErrorCode, Kind, encode_frame

FP = {"model_id": "m", "dtype": "float32"}
SECRET = b"s3cret"


def decode(reply: bytes) -> tuple[Kind, dict]:
    """The kind and header of one encoded frame (no payload)."""
    _, _, kind, header_len, payload_len = PREFIX.unpack_from(reply, 0)
    assert payload_len == 0 and len(reply) == PREFIX_SIZE + header_len
    return Kind(kind), msgpack.unpackb(reply[PREFIX_SIZE:], raw=False)


def hello(name: str = "tx", service: str = "kv-sender", *, fingerprint=None, secret: bytes | None = None) -> dict:
    h = {"service": service, "name": name}
    if fingerprint is not None:
        h["fingerprint"] = fingerprint
    if secret is not None:
        h["auth"] = hello_auth(secret, name, service)
    return h


def test_decode_helper_reads_what_encode_frame_wrote():
    assert decode(encode_frame(Kind.HELLO_OK, {"service": "s", "name": "n"})) == (Kind.HELLO_OK, {"service": "s", "name": "n"})


def test_accepts_a_matching_hello_and_proves_the_secret():
    lis = HelloListener("kv-receiver", "rx", FP, SECRET, require_fingerprint=True)
    h = hello(fingerprint=dict(FP), secret=SECRET)
    ans = lis.answer(Kind.HELLO, h)
    assert (ans.accepted, ans.peer_name, ans.peer_service) == (True, "tx", "kv-sender")
    assert decode(ans.reply) == (Kind.HELLO_OK, {"service": "kv-receiver", "name": "rx",
                                                 "mac": reply_mac(SECRET, h["auth"]["nonce"], "rx")})


def test_accepts_without_secret_and_sends_no_mac():
    ans = HelloListener("router", "r0", None, None).answer(Kind.HELLO, hello(service="gateway", name="gw"))
    assert ans.accepted
    assert decode(ans.reply) == (Kind.HELLO_OK, {"service": "router", "name": "r0"})


def test_first_frame_not_hello_is_bad_frame():
    ans = HelloListener("router", "r0", None, None).answer(Kind.PING, {"t": 1.0})
    assert (ans.accepted, ans.peer_name, ans.peer_service) == (False, "?", "?")
    assert decode(ans.reply) == (Kind.ERROR, {"code": ErrorCode.BAD_FRAME.value, "message": "expected HELLO, got PING"})


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
    ans = lis.answer(Kind.HELLO, hello(fingerprint={**FP, "dtype": "x"}, secret=b"wrong"))
    kind, h = decode(ans.reply)
    assert (ans.accepted, kind, h["code"]) == (False, Kind.ERROR, ErrorCode.AUTH_FAILED.value)
    assert h["message"] == "rx refused the peer: bad auth MAC: the peer does not hold the shared secret"
    assert "float32" not in h["message"]


def test_replayed_hello_refused():
    lis = HelloListener("svc", "srv", None, SECRET)
    h = hello(secret=SECRET)
    assert lis.answer(Kind.HELLO, h).accepted
    kind, err = decode(lis.answer(Kind.HELLO, dict(h)).reply)
    assert (kind, err["code"], err["message"]) == (Kind.ERROR, ErrorCode.AUTH_FAILED.value, "srv refused the peer: replayed auth nonce")


def test_timeout_frame():
    assert decode(hello_timeout_frame()) == (Kind.ERROR, {"code": ErrorCode.TIMEOUT.value,
                                                          "message": "no HELLO within the handshake timeout"})
