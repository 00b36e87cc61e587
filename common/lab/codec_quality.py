"""What a KV wire codec does to a model's outputs, and to its KVCache's size: measured on the real
prefill and paged-decode paths in one process (no sockets).

For each prompt the prefill runs once (``Backend.prefill``); every layer's state is then cut into
``KV_LAYER`` chunks exactly as the sender cuts them (``tensor_ranges``, ``split_ranges``), each chunk
coded and decoded with the wire codec functions (:func:`coded_state`), and written into the paged
pool. The exact rows hold the uncoded state. Then, in one batch per group of prompts, for
``positions`` decode steps:

- **teacher-forced agreement**: the coded row is fed the exact row's greedy tokens, and its greedy
  prediction compared with the exact one at every step (one early flip does not hide the rest). The
  first output token is sampled on the prefill side from uncoded logits, so it always agrees and is
  not counted: the ``positions`` steps are output tokens 2 .. positions + 1;
- **free-running**: another coded row generates greedily on its own; a prompt counts as identical
  when its ``positions`` tokens all equal the exact ones;
- **KL**: ``KL(p_exact || p_coded)`` of the next-token distributions (softmax of the logits, nats)
  at every teacher-forced step: the mean, and the worst step seen; the worst prompt's agreement.

:func:`kv_ratio` measures the bytes a prompt's whole KVCache becomes on the wire per codec, and each
codec's encode and decode rates on one core (Gbit/s of raw KV).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.kv.layout import DTYPES, Layout
from common.transfer import codecs
from common.transfer.coded import span_for
from common.transfer.ranges import DEFAULT_CHUNK_BYTES, split_ranges, tensor_ranges

State = dict[str, torch.Tensor]


def chunks(layout: Layout, state: State, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, int, memoryview]]:
    """``(tensor name, offset in the layer buffer, bytes)`` of every chunk the sender sends for ``state``."""
    out = []
    for name, t in state.items():
        for off, view in split_ranges(tensor_ranges(layout, name, t), chunk_bytes):
            out.append((name, off, view))
    return out


def coded_state(layout: Layout, state: State, codec: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[State, int]:
    """(what the receiver holds for ``state`` after the wire, wire bytes) under transfer codec ``codec``."""
    buf = bytearray(layout["total"])
    wire = 0
    for name, off, view in chunks(layout, state, chunk_bytes):
        c = codecs.frame_codec(codec, name)
        if c == "none":
            buf[off : off + view.nbytes] = view
            wire += view.nbytes
            continue
        data, size = codecs.roundtrip(c, view, span_for(layout, off, view.nbytes, c))
        buf[off : off + view.nbytes] = data
        wire += min(size, view.nbytes) if c not in codecs.LOSSY else size  # an unshrunk lossless chunk goes raw
    out = {}
    for d in layout["tensors"]:
        dtype = DTYPES[d["dtype"]]
        t = torch.frombuffer(buf, dtype=dtype, count=d["nbytes"] // dtype.itemsize, offset=d["offset"]) if d["nbytes"] else \
            torch.empty(0, dtype=dtype)
        out[d["name"]] = t.view(d["shape"])
    return out, wire


def prefill_states(backend, ids: list[int]) -> tuple[list[State], torch.Tensor]:
    """Every layer's final state (wire layout) and the last position's logits."""
    states: list[State] = [{} for _ in range(backend.num_layers)]

    def on_layer(i: int, st: State, _seq_from) -> None:
        states[i] = {k: v.clone() for k, v in st.items()}
    logits = backend.prefill(ids, on_layer)
    return states, logits


def kv_ratio(backend, ids: list[int], names=("lossless", "fp8", "int4")) -> dict[str, dict[str, float]]:
    """Per codec, over one prompt's whole KVCache: ``ratio`` (raw / wire bytes), ``encode_gbps`` and
    ``decode_gbps`` (raw Gbit/s on this thread, one core when torch runs one thread)."""
    states, _ = prefill_states(backend, ids)
    layouts = backend.layer_layouts(len(ids))
    out = {}
    for codec in names:
        raw = wire = 0
        enc = dec = 0.0
        for lay, st in zip(layouts, states):
            for name, off, view in chunks(lay, st):
                c = codecs.frame_codec(codec, name)
                span = span_for(lay, off, view.nbytes, c)
                t0 = time.thread_time()
                payload = bytearray(codecs.encode(c, view, span))
                t1 = time.thread_time()
                codecs.decode_into(c, memoryview(payload), view.nbytes, span, [memoryview(bytearray(view.nbytes))])
                t2 = time.thread_time()
                raw += view.nbytes
                wire += len(payload) if c in codecs.LOSSY else min(len(payload), view.nbytes)
                enc += t1 - t0
                dec += t2 - t1
        out[codec] = {"ratio": raw / wire, "encode_gbps": raw * 8 / max(enc, 1e-9) / 1e9,
                      "decode_gbps": raw * 8 / max(dec, 1e-9) / 1e9, "raw_bytes": raw, "wire_bytes": wire}
    return out


@dataclass
class Quality:
    """One codec's figures over a set of prompts (see the module docstring)."""

    codec: str
    prompts: int = 0
    agree: int = 0
    positions: int = 0
    identical: int = 0
    kl_sum: float = 0.0
    kl_worst: float = 0.0
    worst_prompt_agreement: float = 1.0
    per_prompt: list[float] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.agree / self.positions if self.positions else float("nan")

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else float("nan")

    @property
    def identical_share(self) -> float:
        return self.identical / self.prompts if self.prompts else float("nan")


def measure(backend, prompts: list[list[int]], names: list[str], positions: int = 64, batch: int = 8,
            capacity_bytes: int = 1 << 30, progress=None) -> dict[str, Quality]:
    """Teacher-forced agreement, free-running identity and KL per codec in ``names`` over ``prompts``
    (token id lists). ``progress(n)`` is called after each group of prompts."""
    store = backend.paged_store(capacity_bytes)
    out = {c: Quality(c) for c in names}
    for g in range(0, len(prompts), batch):
        group = prompts[g : g + batch]
        rows, seqs, toks = [], [], []
        for p, ids in enumerate(group):
            states, logits = prefill_states(backend, ids)
            layouts = backend.layer_layouts(len(ids))
            first = int(logits.argmax())
            for kind, codec in [("exact", "none")] + [(k, c) for c in names for k in ("tf", "free")]:
                seq = store.reserve(f"{g}-{p}-{kind}-{codec}", len(ids) + positions + 1)
                for i, st in enumerate(states):
                    held = st if codec == "none" else coded_state(layouts[i], st, codec)[0]
                    store.write_layer(seq, i, held)
                seq.length = len(ids)
                rows.append((p, kind, codec))
                seqs.append(seq)
                toks.append(first)
        exact_tokens: dict[int, list[int]] = {p: [] for p in range(len(group))}
        free_tokens: dict[tuple[int, str], list[int]] = {}
        agree: dict[tuple[int, str], int] = {}
        with torch.inference_mode():
            for _ in range(positions):
                logits = backend.paged_step(store, seqs, toks).float()
                logp = torch.log_softmax(logits, dim=-1)
                exact_row = {p: r for r, (p, kind, _) in enumerate(rows) if kind == "exact"}
                nxt = {p: int(logits[r].argmax()) for p, r in exact_row.items()}
                for r, (p, kind, codec) in enumerate(rows):
                    if kind == "exact":
                        exact_tokens[p].append(nxt[p])
                        toks[r] = nxt[p]
                    elif kind == "tf":
                        q = out[codec]
                        got = int(logits[r].argmax())
                        agree[(p, codec)] = agree.get((p, codec), 0) + (got == nxt[p])
                        e = logp[exact_row[p]]
                        kl = float((e.exp() * (e - logp[r])).sum())
                        q.kl_sum += kl
                        q.kl_worst = max(q.kl_worst, kl)
                        q.positions += 1
                        toks[r] = nxt[p]
                    else:
                        own = int(logits[r].argmax())
                        free_tokens.setdefault((p, codec), []).append(own)
                        toks[r] = own
        for (_p, codec), n in agree.items():
            q = out[codec]
            q.agree += n
            q.per_prompt.append(n / positions)
            q.worst_prompt_agreement = min(q.worst_prompt_agreement, n / positions)
        for (p, codec), seq_toks in free_tokens.items():
            out[codec].identical += seq_toks == exact_tokens[p]
        for c in names:
            out[c].prompts += len(group)
        for s in seqs:
            store.release(s)
        if progress is not None:
            progress(len(group))
    return out
