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


def check_layouts(layouts: Any, num_layers: int, max_total: int) -> list[Layout]:
    """Validate layouts received in ``KV_BEGIN``. Raises :class:`KvError`."""
    if not isinstance(layouts, list) or len(layouts) != num_layers:
        raise KvError(f"expected {num_layers} layer layouts")
    total = 0
    for i, lay in enumerate(layouts):
        try:
            pos = 0
            for d in lay["tensors"]:
                if d["dtype"] not in DTYPES or int(d["offset"]) != pos:
                    raise KvError(f"layer {i}: tensor {d.get('name')} has a bad dtype or offset")
                count = 1
                for s in d["shape"]:
                    count *= int(s)
                if count * DTYPES[d["dtype"]].itemsize != int(d["nbytes"]):
                    raise KvError(f"layer {i}: tensor {d['name']} shape does not match its size")
                pos += int(d["nbytes"])
            if pos != int(lay["total"]):
                raise KvError(f"layer {i}: tensors add up to {pos} bytes, layout says {lay['total']}")
        except KvError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise KvError(f"layer {i}: malformed layout: {e}") from None
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
