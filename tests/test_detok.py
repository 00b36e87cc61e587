"""Tests for ``common.model.detok.IncrementalDetokenizer``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.model.detok import IncrementalDetokenizer, decoder_of
from common.model.tokenizer import build_byte_tokenizer

EOS = 256


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges, so tokens hold several bytes and may split a character."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    t.train_from_iterator(["schön grüße über straße " * 20, "hello world stop here 日本語 テキスト " * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>")


BPE_TOK = _bpe_tokenizer()
BYTE_TOK = build_byte_tokenizer()


def reference(tokenizer, ids, stops, skip_special_tokens=True) -> str:
    """Non-streaming result: the full decoded text cut before the earliest stop occurrence."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    cuts = [i for i in (text.find(s) for s in stops if s) if i != -1]
    return text[: min(cuts)] if cuts else text


def stream(tokenizer, ids, stops=(), skip_special_tokens=True, check_holdback=True):
    """Push ``ids`` until a stop; returns (deltas, stopped, ids_consumed). Flush is the last delta."""
    d = IncrementalDetokenizer(tokenizer, stop=stops, skip_special_tokens=skip_special_tokens)
    deltas: list[str] = []
    emitted = ""
    for n, t in enumerate(ids, 1):
        delta, stopped = d.push(t)
        deltas.append(delta)
        emitted += delta
        for s in stops:
            if s:
                assert s not in delta
                assert s not in emitted
        if stopped:
            assert d.stopped
            assert d.flush() == ""
            assert d.push(ord("x")) == ("", True)
            return deltas, True, n
        if check_holdback:
            # Nothing that may still become a stop string has been released: no released position
            # starts a stop-string prefix that runs to the end of the text decoded so far.
            so_far = tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
            assert so_far.startswith(emitted)
            for p in range(len(emitted)):
                for s in stops:
                    assert not (s and s.startswith(so_far[p:])), (emitted, so_far, s)
    deltas.append(d.flush())
    return deltas, False, len(ids)


def enc(text: str) -> list[int]:
    return list(text.encode("utf-8"))


# --- UTF-8 -------------------------------------------------------------------------------


def test_multibyte_split_across_tokens(tok):
    ids = enc("aö")
    assert ids == [97, 195, 182]
    d = IncrementalDetokenizer(tok)
    assert d.push(97) == ("a", False)
    assert d.push(195) == ("", False)  # half of 'ö': no U+FFFD
    assert d.push(182) == ("ö", False)
    assert d.flush() == ""


def test_four_byte_char_split(tok):
    d = IncrementalDetokenizer(tok)
    out = [d.push(b)[0] for b in enc("x😀y")]
    assert out == ["x", "", "", "", "😀", "y"]
    assert "\ufffd" not in "".join(out)


def test_incomplete_tail_released_at_flush(tok):
    d = IncrementalDetokenizer(tok)
    assert d.push(104) == ("h", False)
    assert d.push(195) == ("", False)
    assert d.flush() == "\ufffd"


def test_invalid_bytes_released_once_resolved(tok):
    ids = [0xFF, 97, 0xE2, 0x82, 98]
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[1] == "\ufffda"


def test_bpe_tokens_splitting_characters():
    ids = BPE_TOK.encode("schön grüße 日本語 テキスト")
    assert any("\ufffd" in BPE_TOK.decode([i]) for i in ids)  # the test needs split characters
    deltas, _, _ = stream(BPE_TOK, ids)
    assert "".join(deltas) == "schön grüße 日本語 テキスト"
    assert all("\ufffd" not in x for x in deltas)


# --- special tokens ----------------------------------------------------------------------


def test_eos_is_skipped(tok):
    d = IncrementalDetokenizer(tok)
    assert d.push(104) == ("h", False)
    assert d.push(EOS) == ("", False)
    assert d.flush() == ""


def test_eos_inside_multibyte_is_skipped(tok):
    ids = [195, EOS, 182]
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == "ö" == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_kept_when_not_skipped(tok):
    ids = enc("hi") + [EOS]
    deltas, _, _ = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "hi<|endoftext|>"


# --- stop strings ------------------------------------------------------------------------


def test_stop_string_spanning_tokens(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    out = []
    for b in enc("abSTOPcd"):
        delta, stopped = d.push(b)
        out.append(delta)
        if stopped:
            break
    assert out == ["a", "b", "", "", "", ""]
    assert stopped and d.matched_stop == "STOP"


def test_partial_stop_released_when_it_diverges(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    out = [d.push(b) for b in enc("STOx")]
    assert out == [("", False), ("", False), ("", False), ("STOx", False)]


def test_held_partial_stop_released_at_flush(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    assert [d.push(b)[0] for b in enc("abST")] == ["a", "b", "", ""]
    assert d.flush() == "ST"


def test_stop_at_very_start(tok):
    deltas, stopped, n = stream(tok, enc("</s>rest"), stops=["</s>"])
    assert stopped and n == 4
    assert "".join(deltas) == ""


def test_stop_inside_one_token():
    ids = BPE_TOK.encode("hello world stop here")
    deltas, stopped, _ = stream(BPE_TOK, ids, stops=["stop"])
    assert stopped
    assert "".join(deltas) == "hello world "


def test_multiple_stops_earliest_wins(tok):
    # "c" completes later than "bc" would start, but "ab" starts earliest.
    deltas, stopped, n = stream(tok, enc("xabcd"), stops=["cd", "ab", "bc"])
    assert stopped and n == 3
    assert "".join(deltas) == "x"


def test_multiple_stops_completing_in_same_token():
    # "ello world stop" is one BPE token; it completes all three stops at once. The one that starts
    # earliest wins, not the first listed.
    ids = BPE_TOK.encode("hello world stop here")
    assert "ello world stop" in [BPE_TOK.decode([i]) for i in ids]
    stops = ["stop", "world", "lo w"]
    deltas, stopped, _ = stream(BPE_TOK, ids, stops=stops)
    assert stopped
    assert "".join(deltas) == reference(BPE_TOK, ids, stops) == "hel"


def test_nested_stops_complete_together_earliest_wins(tok):
    # Both stops end at "b"; "ab" starts first.
    d = IncrementalDetokenizer(tok, stop=["b", "ab"])
    assert d.push(ord("x")) == ("x", False)
    assert d.push(ord("a")) == ("", False)
    assert d.push(ord("b")) == ("", True)
    assert d.matched_stop == "ab"


def test_no_stop_flush_completes(tok):
    text = "hello, wörld 😀"
    deltas, stopped, _ = stream(tok, enc(text), stops=["zzz", "wö!"])
    assert not stopped
    assert "".join(deltas) == text


def test_empty_stop_strings_ignored(tok):
    deltas, stopped, _ = stream(tok, enc("abc"), stops=["", "q"])
    assert not stopped and "".join(deltas) == "abc"


def test_multibyte_stop_string(tok):
    deltas, stopped, n = stream(tok, enc("grüße"), stops=["üß"])
    assert stopped
    assert "".join(deltas) == "gr"


# --- properties --------------------------------------------------------------------------

ALPHABET = "ab ö日😀\n"
stops_strategy = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4)


def _check(tokenizer, ids, stops):
    deltas, stopped, n = stream(tokenizer, ids, stops=stops)
    assert "".join(deltas) == reference(tokenizer, ids[:n], stops)
    if not stopped:
        assert n == len(ids)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=ALPHABET, max_size=40), stops=stops_strategy)
def test_property_random_text(text, stops):
    _check(BYTE_TOK, enc(text), stops)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(
        st.one_of(st.integers(0, 255), st.sampled_from([97, 98, 32, 195, 182, 0xE6, 0x97, 0xA5]), st.integers(256, 259)),
        max_size=40,
    ),
    stops=stops_strategy,
)
def test_property_random_bytes(ids, stops):
    _check(BYTE_TOK, ids, stops)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet="".join(sorted(set("schön grüße 日本語テキスト helo wrd"))), max_size=40), stops=stops_strategy)
def test_property_bpe_tokenizer(text, stops):
    _check(BPE_TOK, BPE_TOK.encode(text), stops)


class _CleanUpFast(PreTrainedTokenizerFast):
    """A fast tokenizer that cleans up spaces before punctuation: the direct Rust call would skip that."""

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).replace(" ,", ",")


@pytest.mark.parametrize("skip", [True, False])
@given(ids=st.lists(st.integers(0, 259), max_size=40))
@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_decoder_of_matches_decode(skip, ids):
    for t in (BYTE_TOK, BPE_TOK):
        ids_t = [i % len(t) for i in ids]
        assert decoder_of(t, skip)(ids_t) == t.decode(ids_t, skip_special_tokens=skip)


def test_decoder_of_takes_the_rust_call_only_when_it_is_the_same():
    assert decoder_of(BYTE_TOK, True).__name__ == "fast"
    overridden = _CleanUpFast(tokenizer_object=BYTE_TOK.backend_tokenizer)
    ids = list(b"a , b")
    assert decoder_of(overridden, True).__name__ == "plain"
    assert decoder_of(overridden, True)(ids) == "a, b"

    class Other:  # not a Hugging Face tokenizer, with a ``_tokenizer`` attribute all the same
        _tokenizer = BYTE_TOK._tokenizer

        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)
    assert decoder_of(Other(), True)([1, 2]) == "xx"
