"""Fault injection for tests and chaos runs, off unless ``PRFAAS_FAULT_INJECTION=1`` in the environment.

A worker exposes its :class:`Faults` through an ``inject_fault`` RPC; with injection disabled the
RPC is refused, so a production process can never be told to damage data.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class FaultsDisabled(PermissionError):
    """``inject_fault`` was called on a process started without ``PRFAAS_FAULT_INJECTION=1``."""


class Faults:
    """Settable faults. ``corrupt_layer``: scale that layer's KVCache state by 0.5 before it is sent."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = os.environ.get("PRFAAS_FAULT_INJECTION") == "1" if enabled is None else enabled
        self.corrupt_layer: int | None = None

    def configure(self, args: dict[str, Any]) -> dict[str, Any]:
        """Apply ``{"corrupt_layer": int | None}``. Raises :class:`FaultsDisabled`, ``ValueError``."""
        if not self.enabled:
            raise FaultsDisabled("fault injection is disabled (start with PRFAAS_FAULT_INJECTION=1)")
        layer = args.get("corrupt_layer")
        if layer is not None and not isinstance(layer, int):
            raise ValueError("corrupt_layer must be an integer or null")
        self.corrupt_layer = layer
        return {"corrupt_layer": self.corrupt_layer}

    def on_layer(self, i: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the layer state to send: damaged if ``i`` is the corrupt layer, else unchanged."""
        if self.corrupt_layer is None or i != self.corrupt_layer:
            return state
        return {k: v * 0.5 for k, v in state.items()}
