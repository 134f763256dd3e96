"""KV migration between instances with different TP/PP layouts: layout, resharding plan, transports, send/recv.

The names below are imported from their modules on first use (PEP 562), so that a process which only plans
migrations (the controller: ``plan``, ``layout``) does not import torch through ``migration`` and ``transport``.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "KVLayout": "layout", "kv_head_range": "layout", "layer_range": "layout",
    "DEFAULT_CHUNK_BYTES": "migration", "MigrationStats": "migration", "StagingBuffers": "migration",
    "blocks_to_send": "migration", "messages": "migration", "pack_blocks": "migration", "recv_kv": "migration",
    "send_kv": "migration", "trim_block_lists": "migration", "unpack_blocks": "migration",
    "MAX_TAG": "plan", "TransferSlice": "plan", "num_tags": "plan", "reshard_plan": "plan",
    "KV_TRANSPORTS": "transport", "InProcessTransport": "transport", "KVTransport": "transport",
    "TorchDistTransport": "transport", "get_transport": "transport", "init_process_group": "transport",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
