"""common/lab/trace.py: the Mooncake trace shipped with the project loads from its default place, and
its replay at 1/32 scale picks the same requests and ideal hits every time; common/lab/synth_trace.py:
synthetic traces of other reuse, in the same format."""

from __future__ import annotations

import gzip
import json

import pytest

from common.lab.synth_trace import SHAPES, TraceShape, synth_trace
from common.lab.trace import (
    BLOCK,
    TRACE,
    block_tokens,
    conversation,
    ideal_hits,
    ideal_rate,
    load_trace,
    scale,
    select,
)


def test_the_shipped_trace_loads_whole_from_its_default_path():
    assert TRACE.name == "mooncake_conversation_trace.jsonl.gz" and TRACE.parent.name == "data"
    assert (TRACE.parent / "LICENSE-Apache-2.0.txt").read_text().lstrip().startswith("Apache License")
    trace = load_trace()
    assert len(trace) == 12031
    assert trace[0] == {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))}


def test_a_plain_jsonl_trace_loads_too(tmp_path):
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 64, "hash_ids": [0, 1]},
            {"timestamp": 5, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    packed = tmp_path / "t.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(plain.read_text())
    assert load_trace(plain) == rows == load_trace(packed)
    reqs = [scale(i, r, 0, 2048, 8) for i, r in enumerate(rows)]
    ideal_hits(reqs)
    # 600 / 32 -> 19 tokens (2 blocks); 1100 / 32 -> 35 tokens (3 blocks), the first two seen before
    assert [len(r.tokens) for r in reqs] == [19, 35] and [r.max_tokens for r in reqs] == [2, 1]
    assert reqs[1].tokens[:2 * BLOCK] == block_tokens(0, 0) + block_tokens(1, 0)
    assert [r.ideal_hit for r in reqs] == [0, 32] and reqs[1].deps == (0,)
    assert ideal_rate(reqs) == 32 / 54


def test_the_quick_replay_is_the_same_every_time():
    trace = load_trace()
    picked = select(trace, 150, 0)
    reqs = [scale(i, trace[i], 0, 2048, 8) for i in picked]
    ideal_hits(reqs)
    assert len(reqs) == 150 and picked == sorted(picked)
    assert round(ideal_rate(reqs), 4) == 0.4874


def test_synthetic_traces_differ_in_reuse_and_keep_conversations_whole():
    rates = {}
    for name, shape in SHAPES.items():
        rows = synth_trace(shape, seed=0)
        assert rows == synth_trace(shape, seed=0) and rows != synth_trace(shape, seed=1)
        assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
        assert all(r["hash_ids"][0] == 0 and len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
        picked = select(rows, 150, 0)
        by_conv = {}
        for i, r in enumerate(rows):
            by_conv.setdefault(conversation(r), []).append(i)
        assert set(picked) == {i for c in {conversation(rows[i]) for i in picked} for i in by_conv[c]}  # whole
        reqs = [scale(i, rows[i], 0, 2048, 8) for i in picked]
        ideal_hits(reqs)
        rates[name] = ideal_rate(reqs)
    assert rates["single"] < 0.3 < rates["branchy"] < rates["agent"]  # reuse: little, branching, most
    # a later turn keeps all but the last (partial) block of the turn it extends
    rows = synth_trace(TraceShape(conversations=1, turns=(2, 2), templates=0, first_blocks=(3, 3), turn_blocks=(1, 1)))
    first, second = (r["hash_ids"] for r in rows)
    assert len(first) == 4 and second[:3] == first[:3] and second[3] != first[3] and len(second) == 5
    with pytest.raises(ValueError):
        synth_trace(TraceShape(turns=(3, 2)))
