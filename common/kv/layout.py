"""KVCache layer layouts: which tensors one layer's state holds, their dtypes, shapes and byte offsets.

A request's KVCache is one buffer per layer; its *layout* names each tensor (``k``/``v`` for an
attention layer, ``conv.<j>``/``rec.<j>`` for a linear one), its dtype name, shape, and where it sits
in the buffer (``offset``, ``nbytes``, back to back in name order). The paged store allocates against
layouts and the transfer engine announces them in ``KV_BEGIN`` (``proto/PROTOCOL.md`` 7.2).
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
Layout = dict[str, Any]  # {"total": bytes, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}]}


class KvError(ValueError):
    """A KV frame or layout is inconsistent (bad layer, range outside the buffer, sizes that disagree)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def make_layout(tensors: list[tuple[str, str, list[int]]]) -> Layout:
    """Lay tensors ``(name, dtype name, shape)`` out back to back in name order. Raises :class:`KvError`."""
    out, pos = [], 0
    for name, dtype, shape in sorted(tensors):
        if dtype not in DTYPES:
            raise KvError(f"unsupported dtype {dtype!r}")
        count = 1
        for s in shape:
            count *= int(s)
        nbytes = count * DTYPES[dtype].itemsize
        out.append({"name": name, "dtype": dtype, "shape": [int(s) for s in shape], "offset": pos, "nbytes": nbytes})
        pos += nbytes
    return {"total": pos, "tensors": out}


MAX_TENSORS_PER_LAYER = 64  # tensors one layer's layout may name (attention: 2; linear: a few states)
MAX_DIMS = 8  # dimensions of one tensor


def _nonneg(v: Any, what: str) -> int:
    """``v`` as an int >= 0 (a bool, a float or a negative number is refused). Raises :class:`KvError`."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise KvError(f"{what} must be an integer >= 0, got {v!r}")
    return v


def check_layouts(layouts: Any, num_layers: int, max_total: int) -> list[Layout]:
    """Validate layouts received in ``KV_BEGIN``: ``num_layers`` layouts, each a map whose ``tensors``
    (at most :data:`MAX_TENSORS_PER_LAYER`) have a known dtype, a shape of at most :data:`MAX_DIMS`
    integer dimensions >= 0 (a negative one would make a positive product of two negatives), sizes
    that match the shape, offsets back to back, and a ``total`` equal to their sum; all layers
    together at most ``max_total`` bytes (checked as the sizes add up, so no product grows past it).
    Raises :class:`KvError`."""
    if not isinstance(layouts, list) or len(layouts) != num_layers:
        raise KvError(f"expected {num_layers} layer layouts")
    total = 0
    for i, lay in enumerate(layouts):
        if not isinstance(lay, dict) or not isinstance(lay.get("tensors"), list):
            raise KvError(f"layer {i}: malformed layout: it must be a map with a list of tensors")
        if len(lay["tensors"]) > MAX_TENSORS_PER_LAYER:
            raise KvError(f"layer {i}: {len(lay['tensors'])} tensors, more than {MAX_TENSORS_PER_LAYER}")
        pos = 0
        for d in lay["tensors"]:
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or d.get("dtype") not in DTYPES:
                raise KvError(f"layer {i}: a tensor has no name or a bad dtype")
            name = d["name"][:64]
            if _nonneg(d.get("offset"), f"layer {i} tensor {name} offset") != pos:
                raise KvError(f"layer {i}: tensor {name} has a bad offset")
            shape = d.get("shape")
            if not isinstance(shape, list) or len(shape) > MAX_DIMS:
                raise KvError(f"layer {i}: tensor {name} shape must be a list of at most {MAX_DIMS} dimensions")
            count = DTYPES[d["dtype"]].itemsize
            for s in shape:
                count *= _nonneg(s, f"layer {i} tensor {name} dimension")
                if count > max_total:
                    raise KvError(f"layouts need more than the {max_total} bytes reserved")
            if count != _nonneg(d.get("nbytes"), f"layer {i} tensor {name} nbytes"):
                raise KvError(f"layer {i}: tensor {name} shape does not match its size")
            pos += count
        if pos != _nonneg(lay.get("total"), f"layer {i} total"):
            raise KvError(f"layer {i}: tensors add up to {pos} bytes, layout says {lay['total']}")
        total += pos
        if total > max_total:
            raise KvError(f"layouts need {total} bytes, more than the {max_total} reserved")
    return layouts


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous tensor ``t`` as a flat ``memoryview`` of its own memory (no copy;
    empty for an empty tensor). Raises :class:`KvError` for a non-contiguous tensor."""
    if not t.is_contiguous():
        raise KvError("tensor bytes must come from contiguous memory")
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
