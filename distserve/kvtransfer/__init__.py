"""KV migration between instances with different TP/PP layouts: layout, resharding plan, transports, send/recv."""

from distserve.kvtransfer.layout import KVLayout, kv_head_range, layer_range
from distserve.kvtransfer.migration import (
    DEFAULT_CHUNK_BYTES,
    MigrationStats,
    StagingBuffers,
    blocks_to_send,
    messages,
    num_tags,
    pack_blocks,
    recv_kv,
    send_kv,
    trim_block_lists,
    unpack_blocks,
)
from distserve.kvtransfer.plan import TransferSlice, reshard_plan
from distserve.kvtransfer.transport import (
    KV_TRANSPORTS,
    InProcessTransport,
    KVTransport,
    TorchDistTransport,
    get_transport,
    init_process_group,
)

__all__ = [
    "KVLayout", "kv_head_range", "layer_range", "DEFAULT_CHUNK_BYTES", "MigrationStats", "StagingBuffers", "blocks_to_send",
    "messages", "num_tags", "pack_blocks", "recv_kv", "send_kv", "trim_block_lists", "unpack_blocks", "TransferSlice",
    "reshard_plan", "KV_TRANSPORTS", "InProcessTransport", "KVTransport", "TorchDistTransport",
    "get_transport", "init_process_group",
]
