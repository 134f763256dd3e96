"""Point-to-point tensor transports for KV migration: torch.distributed, and an in-process one for tests."""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_TAG = 2**31 - 1  # gloo wants a non-negative 32-bit tag


class Handle(ABC):
    """A posted non-blocking send or receive."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completes (a received tensor is valid only after this)."""


class KVTransport(ABC):
    """Sends and receives whole tensors between ranks of one world.

    Peer ids are global ranks in the transport's world. A message is matched by (src, dst, tag);
    messages with the same (src, dst, tag) arrive in the order they were sent. Backends that ignore
    tags (NCCL) match by posting order per (src, dst) pair instead, so callers post a pair's
    messages in the same order on both sides.
    """

    rank: int
    world_size: int
    device: torch.device  # where received tensors are allocated

    @abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        """Post a send of ``tensor``; it must not be modified until the handle's ``wait()`` returns."""

    @abstractmethod
    def irecv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> tuple[Handle, torch.Tensor]:
        """Post a receive into ``out`` (contiguous, or a new tensor if None); valid after ``wait()``."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        handle, tensor = self.irecv(shape, dtype, src, tag, out)
        handle.wait()
        return tensor

    def _check_peer(self, peer: int, tag: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer rank {peer} out of range for world size {self.world_size}")
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag must be in [0, {MAX_TAG}], got {tag}")


def _recv_buffer(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"receive buffer is {tuple(out.shape)} {out.dtype}, expected contiguous {tuple(shape)} {dtype}")
    return out


# ---- in-process ------------------------------------------------------------------------------
class InProcessHub:
    """Queues shared by the ranks of an in-process world, one per (src, dst, tag)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._queues: dict[tuple[int, int, int], queue.SimpleQueue[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def queue(self, src: int, dst: int, tag: int) -> queue.SimpleQueue[torch.Tensor]:
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.SimpleQueue())


class _Done(Handle):
    def wait(self) -> None:
        pass


class _InProcessRecv(Handle):
    def __init__(self, q: queue.SimpleQueue[torch.Tensor], out: torch.Tensor, timeout_s: float, what: str) -> None:
        self._queue, self._out, self._timeout_s, self._what = q, out, timeout_s, what
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            data = self._queue.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no message {self._what} within {self._timeout_s} s") from None
        if data.shape != self._out.shape or data.dtype != self._out.dtype:
            raise ValueError(
                f"message {self._what} is {tuple(data.shape)} {data.dtype} but the receiver expected "
                f"{tuple(self._out.shape)} {self._out.dtype} (do both sides agree on the block count?)"
            )
        self._out.copy_(data)
        self._done = True


class InProcessTransport(KVTransport):
    """Ranks that live in one process (e.g. threads of a test); every message is a private copy."""

    def __init__(self, hub: InProcessHub, rank: int, timeout_s: float = 60.0) -> None:
        if not 0 <= rank < hub.world_size:
            raise ValueError(f"rank {rank} out of range for world size {hub.world_size}")
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.device = torch.device("cpu")
        self.timeout_s = timeout_s

    @classmethod
    def create_world(cls, world_size: int, timeout_s: float = 60.0) -> list["InProcessTransport"]:
        """One transport per rank, all sharing a fresh hub."""
        hub = InProcessHub(world_size)
        return [cls(hub, r, timeout_s) for r in range(world_size)]

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        self._check_peer(dst, tag)
        # Copy now so the receiver never aliases the sender's memory; the send is then complete.
        self.hub.queue(self.rank, dst, tag).put(tensor.detach().clone(memory_format=torch.contiguous_format))
        return _Done()

    def irecv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> tuple[Handle, torch.Tensor]:
        self._check_peer(src, tag)
        buf = _recv_buffer(shape, dtype, self.device, out)
        what = f"from rank {src} to rank {self.rank} with tag {tag}"
        return _InProcessRecv(self.hub.queue(src, self.rank, tag), buf, self.timeout_s, what), buf


# ---- torch.distributed -----------------------------------------------------------------------
class _WorkHandle(Handle):
    def __init__(self, work: dist.Work | None, tensor: torch.Tensor) -> None:
        if work is None:
            raise ValueError("this rank is not a member of the transport's process group")
        self._work = work
        self._tensor = tensor  # keep the buffer alive until the operation completes

    def wait(self) -> None:
        self._work.wait()


def default_backend() -> str:
    """``nccl`` when CUDA (and NCCL) is available, ``gloo`` otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_process_group(
    rank: int, world_size: int, init_method: str, backend: str | None = None, timeout_s: float = 300.0
) -> str:
    """Initialise the default process group (backend chosen by ``default_backend`` if None); returns the backend."""
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    return backend


class TorchDistTransport(KVTransport):
    """``torch.distributed`` point-to-point in an initialised process group (gloo on CPU, NCCL on GPU).

    Peers are global ranks. Gloo matches messages by tag; NCCL ignores tags and matches by order
    per (src, dst) pair, so both sides must post a pair's messages in the same order — the
    migration code does (slices in plan order). Tensors must live on ``self.device``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: str | torch.device | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend(group))
        if device is not None:
            self.device = torch.device(device)
        elif self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        self._check_peer(dst, tag)
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=dst, group=self.group, tag=tag)
        return _WorkHandle(work, tensor)

    def irecv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> tuple[Handle, torch.Tensor]:
        self._check_peer(src, tag)
        buf = _recv_buffer(shape, dtype, self.device, out)
        work = dist.irecv(buf, src=src, group=self.group, tag=tag)
        return _WorkHandle(work, buf), buf

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._check_peer(dst, tag)
        dist.send(tensor.contiguous(), dst=dst, group=self.group, tag=tag)

    def recv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check_peer(src, tag)
        buf = _recv_buffer(shape, dtype, self.device, out)
        dist.recv(buf, src=src, group=self.group, tag=tag)
        return buf


KV_TRANSPORTS: dict[str, type[KVTransport]] = {"inprocess": InProcessTransport, "torch": TorchDistTransport}


def get_transport(name: str, **kwargs: Any) -> KVTransport:
    """Build a transport by registry name (``inprocess``: needs ``hub`` and ``rank``; ``torch``: optional ``group``)."""
    try:
        cls = KV_TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {sorted(KV_TRANSPORTS)}") from None
    return cls(**kwargs)
