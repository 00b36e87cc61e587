"""KVCache layer states to wire frames and back.

Sender side (:func:`layer_frames`): one layer's named tensors are viewed as one logical byte string
(tensors back to back, in name order) and cut into chunks of at most ``chunk_bytes``; each chunk is
one ``KV_LAYER`` frame whose payload is a memoryview of the tensor memory itself (no copy, no pickle).
Every chunk header repeats the layer's tensor descriptors, so chunks may arrive in any order.

Receiver side (:class:`KvAssembly`): the first chunk of a layer allocates that layer's destination
buffer (``total`` bytes); each chunk is copied once into place; a layer is complete when all of its
bytes are in, and its tensors are then views of that buffer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from common.backend import LayerState
from proto.frames import Kind, encode_frame_parts

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB per KV_LAYER frame


class KvError(ValueError):
    """A KV chunk is inconsistent with its layer (bad layer index, offsets, dtype or sizes)."""


def _byte_view(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def layer_frames(req_id: str, layer: int, state: LayerState, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[list]:
    """Encode one layer's state as ``KV_LAYER`` frames, each a list of buffers for ``writelines``.

    ``state`` maps names to CPU tensors; ``chunk_bytes`` (> 0) caps each frame's payload. A layer with
    no tensors still yields one empty frame, so the receiver marks it complete.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    names = sorted(state)
    views = [_byte_view(state[n]) for n in names]
    descs = [
        {"name": n, "dtype": str(state[n].dtype).removeprefix("torch."), "shape": list(state[n].shape), "nbytes": v.nbytes}
        for n, v in zip(names, views)
    ]
    total = sum(v.nbytes for v in views)
    num_chunks = max(1, -(-total // chunk_bytes))
    frames = []
    starts = []
    pos = 0
    for v in views:
        starts.append(pos)
        pos += v.nbytes
    for c in range(num_chunks):
        lo, hi = c * chunk_bytes, min(total, (c + 1) * chunk_bytes)
        parts = []
        for v, s in zip(views, starts):
            a, b = max(lo, s), min(hi, s + v.nbytes)
            if a < b:
                parts.append(v[a - s : b - s])
        header = {
            "req_id": req_id, "layer": layer, "chunk": c, "num_chunks": num_chunks,
            "offset": lo, "total": total, "tensors": descs,
        }
        frames.append(encode_frame_parts(Kind.KV_LAYER, header, parts))
    return frames


class KvAssembly:
    """Reassembles one request's layers from ``KV_LAYER`` chunks, in any order.

    ``layer_ready[i]`` is set when layer ``i`` is complete; ``done`` when ``KV_DONE`` arrived and every
    layer is complete. ``nbytes`` counts the destination bytes allocated so far.
    """

    def __init__(self, req_id: str, num_layers: int, max_layer_bytes: int = 1 << 31):
        self.req_id = req_id
        self.num_layers = num_layers
        self.max_layer_bytes = max_layer_bytes
        self.buffers: dict[int, bytearray] = {}
        self.descs: dict[int, list[dict[str, Any]]] = {}
        self.received: dict[int, set[int]] = {}
        self.received_bytes: dict[int, int] = {}
        self.num_chunks: dict[int, int] = {}
        self.layers: dict[int, LayerState] = {}
        self.layer_ready = [asyncio.Event() for _ in range(num_layers)]
        self.done = asyncio.Event()
        self.final: dict[str, Any] | None = None
        self.error: str | None = None
        self.nbytes = 0

    def add_chunk(self, header: dict[str, Any], payload: bytes | bytearray | memoryview) -> bool:
        """Place one chunk; returns True if it completed its layer. Raises :class:`KvError`."""
        try:
            layer, chunk, n = int(header["layer"]), int(header["chunk"]), int(header["num_chunks"])
            offset, total, descs = int(header["offset"]), int(header["total"]), header["tensors"]
        except (KeyError, TypeError, ValueError) as e:
            raise KvError(f"malformed KV_LAYER header: {e}") from None
        if not 0 <= layer < self.num_layers:
            raise KvError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if layer in self.layers:
            return False  # a duplicate of a completed layer
        if not 0 <= chunk < n or total < 0 or total > self.max_layer_bytes:
            raise KvError(f"bad chunk {chunk}/{n} or layer size {total}")
        if offset < 0 or offset + len(payload) > total:
            raise KvError(f"chunk [{offset}, {offset + len(payload)}) outside layer of {total} bytes")
        if layer not in self.buffers:
            if not isinstance(descs, list) or sum(int(d["nbytes"]) for d in descs) != total:
                raise KvError("tensor descriptors do not add up to the layer size")
            self.buffers[layer] = bytearray(total)
            self.descs[layer] = descs
            self.received[layer] = set()
            self.received_bytes[layer] = 0
            self.num_chunks[layer] = n
            self.nbytes += total
        elif total != len(self.buffers[layer]) or n != self.num_chunks[layer]:
            raise KvError(
                f"chunk {chunk} of layer {layer} says {total} bytes in {n} chunks; the layer has "
                f"{len(self.buffers[layer])} bytes in {self.num_chunks[layer]} chunks"
            )
        if chunk in self.received[layer]:
            return False
        self.buffers[layer][offset : offset + len(payload)] = payload
        self.received[layer].add(chunk)
        self.received_bytes[layer] += len(payload)
        if len(self.received[layer]) < n:
            return False
        if self.received_bytes[layer] != total:
            raise KvError(f"layer {layer}: its {n} chunks carried {self.received_bytes[layer]} bytes, expected {total}")
        self.layers[layer] = self._tensors(layer)
        self.layer_ready[layer].set()
        self._maybe_done()
        return True

    def _tensors(self, layer: int) -> LayerState:
        buf, out, pos = self.buffers[layer], {}, 0
        for d in self.descs[layer]:
            dtype = DTYPES.get(d["dtype"])
            if dtype is None:
                raise KvError(f"unsupported dtype {d['dtype']!r}")
            shape, nbytes = [int(x) for x in d["shape"]], int(d["nbytes"])
            count = 1
            for s in shape:
                count *= s
            if count * dtype.itemsize != nbytes:
                raise KvError(f"tensor {d['name']} shape {shape} does not match {nbytes} bytes")
            t = torch.frombuffer(buf, dtype=dtype, count=count, offset=pos) if count else torch.empty(0, dtype=dtype)
            out[str(d["name"])] = t.view(shape)
            pos += nbytes
        return out

    def finish(self, header: dict[str, Any]) -> None:
        """Record ``KV_DONE`` (first token, prompt length)."""
        self.final = header
        self._maybe_done()

    def abort(self, reason: str) -> None:
        """Mark the transfer failed (``KV_ABORT`` or a bad chunk); waiters on :attr:`done` wake up."""
        self.error = reason
        self.done.set()

    def _maybe_done(self) -> None:
        if self.final is not None and len(self.layers) == self.num_layers:
            self.done.set()

    def ordered_layers(self) -> list[LayerState]:
        """All layers in order; call only once :attr:`done` is set."""
        return [self.layers[i] for i in range(self.num_layers)]
