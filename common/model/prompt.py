"""Prompt checks shared by every worker that takes token ids from a peer (prefill and decode)."""

from __future__ import annotations

from typing import Any

from common.rpc.errors import RpcError
from proto.frames import ErrorCode


def validate_prompt(input_ids: Any, vocab_size: int, max_len: int) -> list[int]:
    """Check a token-id prompt; returns it as ``list[int]``. Raises :class:`RpcError` BAD_REQUEST."""
    if not isinstance(input_ids, list) or not input_ids:
        raise RpcError(ErrorCode.BAD_REQUEST, "input_ids must be a non-empty list of token ids")
    if len(input_ids) > max_len:
        raise RpcError(ErrorCode.BAD_REQUEST, f"prompt of {len(input_ids)} tokens exceeds the {max_len}-token context")
    if set(map(type, input_ids)) == {int} and 0 <= min(input_ids) and max(input_ids) < vocab_size:
        return input_ids  # the common case in C-speed passes (~10x faster than the generator below)
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in input_ids):
        raise RpcError(ErrorCode.BAD_REQUEST, f"input_ids must be integers in [0, {vocab_size})")
    return input_ids
