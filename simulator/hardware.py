"""Accelerator specs for the latency models: datasheet numbers, and a measured spec of this CPU."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from distserve.errors import InvalidConfigError

_GIB = 1 << 30
_MIB = 1 << 20


@dataclass(frozen=True)
class HardwareSpec:
    """One device type. Bandwidths are bytes/s in ONE direction (what a send or a ring step uses).

    The ``*_efficiency`` fields are the achievable fractions of the peak numbers; the roofline model
    multiplies by them, so datasheet peaks stay recognisable here.
    """

    name: str
    peak_flops: float  # dense bf16/fp16 FLOP/s per device
    mem_bandwidth: float  # bytes/s device memory
    mem_bytes: float  # device memory size
    intra_node_bandwidth: float  # bytes/s per device pair inside a node (NVLink / PCIe)
    inter_node_bandwidth: float  # bytes/s per device across nodes (network)
    flops_efficiency: float = 0.7  # large GEMMs reach ~70-80% of peak; whole-model prefill a bit less
    bandwidth_efficiency: float = 0.8  # weight/KV streaming reaches ~80% of HBM peak
    comm_efficiency: float = 0.75  # NCCL bus bandwidth vs link peak
    step_overhead_s: float = 2e-3  # kernel launches, sampling and scheduling per step
    link_latency_s: float = 1e-5  # per message (NCCL small-message latency)

    def __post_init__(self) -> None:
        for field_name in ("peak_flops", "mem_bandwidth", "mem_bytes", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, field_name) > 0:
                raise InvalidConfigError(f"hardware {self.name!r}: {field_name} must be > 0")
        for field_name in ("flops_efficiency", "bandwidth_efficiency", "comm_efficiency"):
            value = getattr(self, field_name)
            if not 0 < value <= 1:
                raise InvalidConfigError(f"hardware {self.name!r}: {field_name} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0 or self.link_latency_s < 0:
            raise InvalidConfigError(f"hardware {self.name!r}: overheads must be >= 0")


# Memory sizes are the totals nvidia-smi reports (the datasheet "80 GB" of an A100 is 80 GiB).
# NVLink/PCIe datasheet figures are bidirectional; we store half (one direction).
HARDWARE: dict[str, HardwareSpec] = {
    # A100-80G SXM: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e, 80 GiB (81920 MiB),
    # NVLink3 600 GB/s total (300 GB/s each way), 200 Gb/s HDR InfiniBand per GPU (typical DGX A100).
    "a100-80g": HardwareSpec(
        name="a100-80g",
        peak_flops=312e12,
        mem_bandwidth=2.039e12,
        mem_bytes=81920 * _MIB,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=200e9 / 8,
    ),
    # H100 SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB (81559 MiB),
    # NVLink4 900 GB/s total (450 GB/s each way), 400 Gb/s NDR InfiniBand per GPU (DGX H100).
    "h100-sxm": HardwareSpec(
        name="h100-sxm",
        peak_flops=989e12,
        mem_bandwidth=3.35e12,
        mem_bytes=81559 * _MIB,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=400e9 / 8,
        step_overhead_s=1.5e-3,
    ),
    # H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, 141 GB (143771 MiB),
    # NVLink4 900 GB/s total (450 GB/s each way), 400 Gb/s NDR InfiniBand per GPU.
    "h200": HardwareSpec(
        name="h200",
        peak_flops=989e12,
        mem_bandwidth=4.8e12,
        mem_bytes=143771 * _MIB,
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=400e9 / 8,
        step_overhead_s=1.5e-3,
    ),
    # L40S: 362 TFLOP/s dense bf16 (733 with sparsity), 864 GB/s GDDR6, 48 GB (46068 MiB with ECC),
    # no NVLink: PCIe Gen4 x16 64 GB/s total (32 GB/s each way), 100 Gb/s Ethernet per GPU typical.
    "l40s": HardwareSpec(
        name="l40s",
        peak_flops=362e12,
        mem_bandwidth=864e9,
        mem_bytes=46068 * _MIB,
        intra_node_bandwidth=32e9,
        inter_node_bandwidth=100e9 / 8,
        comm_efficiency=0.6,
    ),
}


def get_hardware(name: str) -> HardwareSpec:
    """The spec named ``name`` (case-insensitive); ``"cpu"`` measures this machine.

    Raises:
        InvalidConfigError: the name is unknown (the message lists the known names).
    """
    key = name.strip().lower()
    if key == "cpu":
        return measure_local_cpu()
    spec = HARDWARE.get(key)
    if spec is None:
        known = ", ".join([*sorted(HARDWARE), "cpu"])
        raise InvalidConfigError(f"unknown hardware {name!r}; known: {known}")
    return spec


@functools.cache
def measure_local_cpu() -> HardwareSpec:
    """This machine as a device, measured once per process with numpy (~1 s).

    GEMM FLOP/s from float32 matmuls, memory bandwidth from a large array copy, memory size from
    ``os.sysconf``, and loopback TCP bandwidth/latency for both intra- and inter-node links (a CPU
    "cluster" here is processes on one host). The numbers are achieved, not peak, so the
    efficiencies are 1.
    """
    latency_s, tcp_bandwidth = _measure_loopback_tcp()
    return HardwareSpec(
        name="cpu",
        peak_flops=_measure_gemm_flops(),
        mem_bandwidth=_measure_copy_bandwidth(),
        mem_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        intra_node_bandwidth=tcp_bandwidth,
        inter_node_bandwidth=tcp_bandwidth,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        comm_efficiency=1.0,
        # Python-side scheduling and sampling of one CPU engine step; a fitted profile captures it better.
        step_overhead_s=1e-3,
        link_latency_s=latency_s,
    )


def _best_rate(work: float, run: Callable[[], object], budget_s: float, min_reps: int = 3) -> float:
    """Highest ``work / seconds`` over repetitions of ``run()`` within ``budget_s``."""
    best = 0.0
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        run()
        elapsed = time.perf_counter() - t0
        best = max(best, work / max(elapsed, 1e-9))
        reps += 1
        if reps >= 50:
            break
    return best


def _measure_gemm_flops(n: int = 1024, budget_s: float = 0.4) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)  # warm-up: thread pool start, page faults
    return _best_rate(2.0 * n**3, lambda: np.matmul(a, b, out=out), budget_s)


def _measure_copy_bandwidth(num_bytes: int = 64 * _MIB, budget_s: float = 0.25) -> float:
    src = np.ones(num_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return _best_rate(2.0 * src.nbytes, lambda: np.copyto(dst, src), budget_s)  # read + write


def _measure_loopback_tcp(num_bytes: int = 64 * _MIB, chunk: int = _MIB, pings: int = 200) -> tuple[float, float]:
    """(one-way latency in s, bandwidth in bytes/s) of a TCP connection over 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    with client, peer:
        for s in (client, peer):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def echo() -> None:
            buf = bytearray(1)
            for _ in range(pings):
                peer.recv_into(buf, 1)
                peer.sendall(buf)

        thread = threading.Thread(target=echo, daemon=True)
        thread.start()
        one = b"x"
        t0 = time.perf_counter()
        for _ in range(pings):
            client.sendall(one)
            client.recv(1)
        latency_s = (time.perf_counter() - t0) / pings / 2
        thread.join()

        payload = bytes(chunk)
        received = [0]

        def sink() -> None:
            buf = bytearray(chunk)
            while received[0] < num_bytes:
                n = peer.recv_into(buf)
                if n == 0:
                    break
                received[0] += n

        thread = threading.Thread(target=sink, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        for _ in range(num_bytes // chunk):
            client.sendall(payload)
        thread.join()
        bandwidth = received[0] / max(time.perf_counter() - t0, 1e-9)
    return latency_s, bandwidth
