"""DecodeRequest.push: how one sampled token ends (or not) a request. No sockets, no model."""

from __future__ import annotations

from common.model.sampling import SamplingParams
from common.model.tokenizer import build_byte_tokenizer
from services.decode.request import DecodeRequest

TOK = build_byte_tokenizer()


def drain(req: DecodeRequest) -> list[dict]:
    out = []
    while not req.out.empty():
        out.append(req.out.get_nowait())
    return out


def test_eos_finishes_with_stop_and_counts_the_token():
    req = DecodeRequest("r", SamplingParams(max_tokens=10, stop_token_ids=(256,)), 7, TOK)
    for t in b"ab":
        req.push(t)
    req.push(256)
    items = drain(req)
    assert [i["finish_reason"] for i in items] == [None, None, "stop"]
    assert "".join(i["text"] for i in items) == "ab"
    assert items[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}


def test_ignore_eos_keeps_going_until_length():
    # the gateway leaves the EOS ids out of stop_token_ids under ignore_eos
    req = DecodeRequest("r", SamplingParams(max_tokens=2, stop_token_ids=(), ignore_eos=True), 1, TOK)
    req.push(256)
    assert not req.done
    req.push(65)
    assert [i["finish_reason"] for i in drain(req)] == [None, "length"]


def test_client_stop_token_ids_end_generation_even_with_ignore_eos():
    req = DecodeRequest("r", SamplingParams(max_tokens=5, stop_token_ids=(66,), ignore_eos=True), 1, TOK)
    req.push(65)
    req.push(66)
    items = drain(req)
    assert [i["finish_reason"] for i in items] == [None, "stop"] and "".join(i["text"] for i in items) == "A"


def test_min_tokens_holds_stop_strings_and_stop_tokens_back():
    req = DecodeRequest("r", SamplingParams(max_tokens=8, stop=("b",), stop_token_ids=(256,), min_tokens=3), 1, TOK)
    for t in (97, 98, 256):  # "a", "b" (a stop string), EOS: all before min_tokens is reached
        req.push(t)
    assert not req.done
    req.push(98)  # the 4th token: "b" now stops
    items = drain(req)
    assert [i["finish_reason"] for i in items] == [None, None, None, "stop"]
    assert "".join(i["text"] for i in items) == "ab"


def test_max_tokens_one_finishes_on_the_first_token():
    req = DecodeRequest("r", SamplingParams(max_tokens=1), 3, TOK)
    req.push(72)
    (item,) = drain(req)
    assert item["finish_reason"] == "length" and item["text"] == "H" and req.done


def test_stop_string_spanning_tokens_is_cut():
    req = DecodeRequest("r", SamplingParams(max_tokens=50, stop=("END",)), 1, TOK)
    for t in b"hello EN":
        req.push(t)
    assert not req.done
    req.push(ord("D"))
    items = drain(req)
    assert "".join(i["text"] for i in items) == "hello " and items[-1]["finish_reason"] == "stop"
    assert items[-1]["usage"]["completion_tokens"] == 9


def test_split_utf8_is_held_until_complete():
    req = DecodeRequest("r", SamplingParams(max_tokens=5), 1, TOK)
    a, b = "ö".encode()
    req.push(a)
    req.push(b)
    texts = [i["text"] for i in drain(req)]
    assert texts == ["", "ö"]
