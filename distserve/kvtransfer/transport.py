"""Point-to-point tensor transports for KV migration: torch.distributed, and an in-process one for tests."""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from distserve.kvtransfer.plan import MAX_TAG

CANCEL_POLL_S = 0.02  # how often a wait that can be cancelled looks at its cancel event
# The backend timeout of the KV group (``new_kv_group``): effectively never. Transfers enforce their
# own deadline in ``Handle.wait``; this one would only fire in a thread left waiting on an op whose
# peer never came, and firing would close every connection of the group.
KV_GROUP_TIMEOUT_S = 10 * 365 * 24 * 3600.0


class TransferTimeout(TimeoutError):
    """A posted send or receive did not complete before its deadline."""


class TransferCancelled(RuntimeError):
    """A wait was given up because its cancel event was set (e.g. the peer already failed)."""


class Handle(ABC):
    """A posted non-blocking send or receive."""

    @abstractmethod
    def wait(self, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        """Block until the operation completes (a received tensor is valid only after this).

        Raises ``TransferTimeout`` if it has not completed within ``timeout_s`` seconds (None: the
        transport's own limit) and ``TransferCancelled`` once ``cancel`` is set. Either way the
        operation stays posted — no backend can withdraw it — so its buffer must be kept alive and
        never reused (``KVTransport.abandon``); a late peer may still complete it.
        """


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
    abandoned: list[Handle]  # ops given up on (see ``abandon``)

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

    def abandon(self, handles: Iterable[Handle]) -> None:
        """Keep ops that were given up on (timeout, cancel, error) and their buffers alive for good.

        A posted op cannot be withdrawn and a late peer may still complete it: its memory must never
        be freed or reused. Tags are unique per transfer, so a late message only ever lands here.
        """
        self.abandoned.extend(handles)

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
    def wait(self, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        pass


class _InProcessRecv(Handle):
    def __init__(self, q: queue.SimpleQueue[torch.Tensor], out: torch.Tensor, timeout_s: float, what: str) -> None:
        self._queue, self._out, self._timeout_s, self._what = q, out, timeout_s, what
        self._done = False

    def wait(self, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        if self._done:
            return
        limit = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        deadline = time.monotonic() + limit
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                data = self._queue.get(timeout=remaining if cancel is None else min(remaining, CANCEL_POLL_S))
                break
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise TransferCancelled(f"receive {self._what} cancelled") from None
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"no message {self._what} within {limit} s") from None
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
        self.abandoned = []

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
class _Waiter:
    """Waits for one torch.distributed op on a daemon thread, so the caller can give up on a deadline.

    Gloo's own ``Work.wait(timeout)`` cannot be used: when it times out, gloo closes every
    connection of the process group ("Application timeout caused pair closure"), and posted ops
    cannot be cancelled from Python. So the op is waited on without a timeout here (in the KV group
    the backend timeout never fires, ``new_kv_group``) and the caller stops waiting instead. The
    thread of an op that never completes stays parked, holding the op and its buffer; if its peer
    exits while this process is shutting down, the waking thread aborts the exit (Python < 3.12
    ends daemon threads with a forced unwind that torch's wait cannot pass) — a killed actor does not care.
    """

    def __init__(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(work, tensor), name="kv-wait", daemon=True).start()

    def _run(self, work: dist.Work, tensor: torch.Tensor) -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = exc
        finally:
            self.done.set()

    def join(self, timeout_s: float | None, cancel: threading.Event | None, what: str) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done.is_set():
            if cancel is not None and cancel.is_set():
                raise TransferCancelled(f"{what} cancelled")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransferTimeout(f"{what} did not complete within {timeout_s} s")
            step = remaining if cancel is None else min(CANCEL_POLL_S, remaining or CANCEL_POLL_S)
            self.done.wait(step)
        if self.error is not None:
            raise self.error


class _WorkHandle(Handle):
    def __init__(self, work: dist.Work | None, tensor: torch.Tensor, what: str) -> None:
        if work is None:
            raise ValueError("this rank is not a member of the transport's process group")
        self._work = work
        self._tensor = tensor  # keep the buffer alive until the operation completes
        self._what = what
        self._waiter: _Waiter | None = None

    def wait(self, timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        if timeout_s is None and cancel is None and self._waiter is None:
            self._work.wait()
            return
        if self._waiter is None:
            self._waiter = _Waiter(self._work, self._tensor)
        self._waiter.join(timeout_s, cancel, self._what)


def default_backend() -> str:
    """``nccl`` when CUDA (and NCCL) is available, ``gloo`` otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_process_group(
    rank: int, world_size: int, init_method: str | None, backend: str | None = None, timeout_s: float = 300.0,
    store: dist.Store | None = None,
) -> str:
    """Initialise the default process group (backend chosen by ``default_backend`` if None); returns the
    backend. Either ``init_method`` (torch's rendezvous) or ``store`` (every rank's: ``open_rendezvous``,
    ``join_rendezvous``)."""
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=None if store is not None else init_method, store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


def open_rendezvous(world_size: int, host: str, timeout_s: float = 300.0) -> tuple[str, dist.TCPStore]:
    """Global rank 0's side of a world's rendezvous: its address ``tcp://host:port`` and the store serving
    it, bound to a port the OS picks as it binds. A port chosen first and bound later (torch's ``tcp://``
    rendezvous on a free port found beforehand, as vLLM does) can be taken by another listener in between
    (EADDRINUSE, seen in CI); this one cannot. Every rank then passes its store to ``init_process_group``."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return f"tcp://{host}:{store.port}", store


def join_rendezvous(address: str, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Another rank's side of ``open_rendezvous``: a client of the store at its ``address``."""
    parsed = urlsplit(address)
    if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
        raise ValueError(f"a rendezvous address is tcp://host:port, got {address!r}")
    return dist.TCPStore(parsed.hostname, parsed.port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def new_kv_group() -> dist.ProcessGroup:
    """A group of every rank for KV transfers only. Collective: every rank calls it, before any other ``new_group``.

    Transfers give up on their own deadline (``Handle.wait``) and leave ops posted that may never
    complete; in a separate group whose backend timeout never fires, those can neither close the
    default group's connections (pipeline sends, collectives) nor this group's.
    """
    group = dist.new_group(timeout=timedelta(seconds=KV_GROUP_TIMEOUT_S))
    assert group is not None
    return group


class TorchDistTransport(KVTransport):
    """``torch.distributed`` point-to-point in an initialised process group (gloo on CPU, NCCL on GPU).

    Peers are global ranks. Gloo matches messages by tag; NCCL ignores tags and matches by order
    per (src, dst) pair, so both sides must post a pair's messages in the same order — the
    migration code does (slices in plan order). Tensors must live on ``self.device``. Pass a
    ``new_kv_group()`` group when waits use a timeout (see ``_Waiter``).
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
        self.abandoned = []

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        self._check_peer(dst, tag)
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=dst, group=self.group, tag=tag)
        return _WorkHandle(work, tensor, f"send from rank {self.rank} to rank {dst} with tag {tag}")

    def irecv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> tuple[Handle, torch.Tensor]:
        self._check_peer(src, tag)
        buf = _recv_buffer(shape, dtype, self.device, out)
        work = dist.irecv(buf, src=src, group=self.group, tag=tag)
        return _WorkHandle(work, buf, f"receive from rank {src} to rank {self.rank} with tag {tag}"), buf

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
