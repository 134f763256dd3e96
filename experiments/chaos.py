"""Reliability under faults, overload and shutdown (issue 20): `distserve serve --runtime ray` (1 prefill,
1 decode with TP=2, or PP=2 for a model whose heads do not split in two; a KV cache smaller than the load) driven by streaming clients, with a ledger of every
request (``chaos_client.py``: how each ended, and whether its text equals its greedy reference).

Rows, in order (``--rows`` picks some; the fault-free wave always runs first):
- fault-free: a wave of requests in flight (chat, completions, a two-call dataflow program every tenth);
- the same wave with a fault injected once a quarter of it streams: SIGKILL of the decode instance's
  second rank (a worker actor), of the prefill instance actor, of both at once, of the controller
  actor; SIGSTOP of the KV sender (prefill) or receiver (decode worker) for 2.5x the KV-transfer
  timeout (the transfer stalls past its deadline), then SIGCONT; and KV transfers lost on the wire (``drop-sends``:
  the server restarted with every 5th KV send of its workers posting nothing yet reporting success, so the
  receiver times out and the request is prefilled again; then restarted without it);
- KV exhaustion: long prompts with long outputs that together exceed the cache (preemption, no error), and one prompt
  larger than the whole cache (400 at admission);
- disconnect storm: clients dropping their connection after the first streamed chunk;
- soak at 70% of the planned goodput (on the server every row above ran on): RSS of every server
  process after warm-up vs at the end;
- overload: Poisson arrivals at 10x the planned goodput; then back to normal latency. The SLO is twice
  the fault-free wave's p90 TTFT and TPOT. The planned goodput is DistServe's goodput measured on this
  server right after the fault-free wave (row "goodput search", ``chaos_rows.planned_goodput``): the
  highest Poisson rate at which >= 90% of requests meet that SLO, found by a few probes starting at the
  wave's completion rate, each as long as the burst (a shorter one passes rates the server cannot hold
  that long: the backlog stays within a loose TTFT SLO until the probe ends), each passing probe
  repeated (``--goodput-confirmations``) so that one lucky probe does not set it. The server is restarted before the overload row configured for the SLO
  (``slo_flags``: ``--max-queue-delay`` at ``--queue-share`` of the TTFT SLO, ``--tpot-backpressure`` at ``--tpot-share`` of the TPOT SLO),
  as an operator deploys for an SLO, and the shutdown row runs on that server. The admitted rate is measured as the
  planned goodput is: admitted arrivals per second of the burst (``admitted_rps``; a probe's rate is its arrivals per
  second of the probe, its final backlog included); the admitted requests per second from the first one's arrival to
  the last one's end (the drain included) are in the row too (``admitted_completion_rps``);
- graceful shutdown: SIGTERM with a wave in flight.
After every row the server must go idle with every KV block free, and new requests must succeed.
Recovery time: kill -> the replacement is up (restart counted; for the controller: /health answers
again); stall -> the first request completing after the stopped process resumed; overload -> a probe's
TTFT is back within 2x the idle one, counted from when the burst's admitted requests have all ended
(``drain_s``: how long after the last arrival that was); shutdown -> exit.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from glob import glob
from typing import Any

import chaos_client as cc
import harness
import aiohttp
import httpx
from chaos_rows import DROP_EVERY, dropped_sends, kv_exhaustion, overload, planned_goodput, shutdown, slo_flags, soak, storm

from distserve.cli.arg_types import fraction, non_negative_int, positive_float, positive_int
from distserve.cli.args import latency_type
from distserve.measure.benchserve import ServerProcess, distserve_serve_argv, metric_sums, session_pids

ROWS = ("faults", "kv", "storm", "soak", "overload", "shutdown")
FAULTS = ("decode-worker", "prefill-instance", "both", "controller", "stall-sender", "stall-receiver", "drop-sends")
GAUGE = re.compile(r'^distserve:(\w+)\{([^}]*)\}\s+(\S+)$', re.MULTILINE)
IDLE_TIMEOUT_S = 90.0


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, "tiny model, 24 in flight, two faults (decode worker, controller), seconds of overload and soak")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", type=harness.model_dtype, default="float32")
    ap.add_argument("--in-flight", type=positive_int, default=200, help="requests per wave, all sent at once")
    ap.add_argument("--max-tokens", type=positive_int, default=16, help="output tokens per request (exact)")
    ap.add_argument("--cache-tokens", type=positive_int, default=4096, help="KV cache per instance, in tokens")
    ap.add_argument("--kv-transfer-timeout", type=positive_float, default=3.0)
    ap.add_argument("--faults", default=None, help=f"comma-separated, of {','.join(FAULTS)} (default: all; --quick: decode-worker,controller)")
    ap.add_argument("--storm", type=positive_int, default=500, help="clients in the disconnect storm")
    ap.add_argument("--goodput-probes", type=positive_int, default=5, help="Poisson probes that search the planned goodput")
    ap.add_argument("--goodput-confirmations", type=non_negative_int, default=None,
                    help="repeats in the goodput search (default: --goodput-probes, every pass repeated): a probe that passes is "
                    "repeated at once, and its rate counts as passed only if the repeat passes too (0: no repeat, the planned "
                    "goodput may be a probe that passed by luck)")
    ap.add_argument("--goodput-probe-s", type=positive_float, default=None,
                    help="seconds of arrivals per goodput probe (default: --overload-s, so the planned goodput is a rate the server "
                    "held for as long as the burst lasts: a shorter probe passes rates above what it can sustain, as the backlog "
                    "it builds stays within a loose TTFT SLO until the probe ends)")
    ap.add_argument("--planned-goodput", type=positive_float, default=None,
                    help="req/s: use this planned goodput (e.g. an earlier run's) instead of searching for it")
    ap.add_argument("--ttft-slo", type=latency_type("--ttft-slo"), default=None, metavar="LATENCY",
                    help="with --tpot-slo: use this SLO (e.g. an earlier run's) instead of twice the fault-free wave's p90 TTFT and TPOT")
    ap.add_argument("--tpot-slo", type=latency_type("--tpot-slo"), default=None, metavar="LATENCY", help="see --ttft-slo")
    ap.add_argument("--tpot-share", type=fraction, default=0.75,
                    help="the overload row's server holds decoding to this share of the TPOT SLO (--tpot-slo with "
                    "--tpot-backpressure: the decode headroom); the rest of the SLO is slack for the steps of requests already admitted")
    ap.add_argument("--queue-share", type=fraction, default=0.75,
                    help="the overload row's server refuses a request predicted to wait more than this share of the TTFT SLO "
                    "(--max-queue-delay); the rest of the SLO is for the prefill, its wait on the instance and the KV migration")
    ap.add_argument("--overload-s", type=positive_float, default=120.0)
    ap.add_argument("--soak-s", type=positive_float, default=1200.0)
    ap.add_argument("--deadline", type=positive_float, default=600.0, help="seconds after which a request counts as hung")
    ap.add_argument("--startup-timeout", type=positive_float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ROWS)} (default: all; fault-free always runs: "
                    "it measures the planned goodput and the SLO)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.in_flight, args.max_tokens, args.cache_tokens = "tiny", 24, 12, 768
        args.storm, args.overload_s, args.soak_s, args.deadline = 30, 3.0, 4.0, 150.0
        # One probe and its repeat: both paths of the search run (its bisection is tested on its own: test_chaos_search.py).
        args.goodput_probes, args.goodput_probe_s, args.goodput_confirmations = 1, 3.0, 1
        args.faults = args.faults or "decode-worker,controller"
    args.faults = [f for f in (args.faults or ",".join(FAULTS)).split(",") if f]
    args.rows = [r for r in args.rows.split(",") if r]
    if args.goodput_probe_s is None:
        args.goodput_probe_s = args.overload_s
    if args.goodput_confirmations is None:
        args.goodput_confirmations = args.goodput_probes
    if args.queue_share == 1:  # in (0, 1] by its type
        ap.error(f"--queue-share must be in (0, 1), got {args.queue_share}")
    if (args.ttft_slo is None) != (args.tpot_slo is None):
        ap.error("--ttft-slo and --tpot-slo go together (the SLO of an earlier run), or neither (the fault-free wave sets it)")
    if set(args.rows) - set(ROWS):
        ap.error(f"--rows: unknown {sorted(set(args.rows) - set(ROWS))}; choose from {','.join(ROWS)}")
    bad = set(args.faults) - set(FAULTS)
    if bad:
        ap.error(f"--faults: unknown {sorted(bad)}; choose from {','.join(FAULTS)}")
    return args


class Run:
    """The server under test, the ledger and the figures measured so far."""

    def __init__(self, args: argparse.Namespace, servers: list[ServerProcess], client: aiohttp.ClientSession) -> None:
        self.args, self.server, self.client = args, servers[-1], client
        self.servers = servers  # every server started (the last one is running)
        server = self.server
        self.root = server.base_url.removesuffix("/v1")
        self.ledger = cc.Ledger()
        self.refs: dict[str, str] = {}
        self.rows: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self.request_log: str | None = None  # the server's ``--request-log`` (overload row)

    # ---- the server's state ----------------------------------------------------------------------
    def actor_pids(self) -> dict[str, int]:
        """Live actor processes by the name Ray logs for them (``InstanceServer(prefill-0)``, ``ControllerActor``...)."""
        assert self.server.sid is not None
        live = set(session_pids(self.server.sid))
        names: dict[str, int] = {}
        for path in glob(str(self.server.work_dir / "ray" / "session_*" / "logs" / "worker-*.out")):
            pid = int(path.rsplit("-", 1)[1].removesuffix(".out"))
            if pid in live:
                with open(path, errors="replace") as f:
                    head = [line for line in f.read(16384).splitlines() if line.startswith(":actor_name:")]
                if head:
                    names[head[-1].removeprefix(":actor_name:")] = pid
        return names

    def gauges(self, name: str) -> dict[str, float]:
        """One ``distserve:`` gauge per engine label."""
        try:
            text = httpx.get(self.root + "/metrics", timeout=5.0).text
        except httpx.HTTPError:
            return {}
        out = {}
        for metric, labels, value in GAUGE.findall(text):
            engine = re.search(r'engine="([^"]*)"', labels)
            if metric == name and engine:
                out[engine.group(1)] = float(value)
        return out

    def num_blocks(self) -> dict[str, int]:
        text = httpx.get(self.root + "/metrics", timeout=5.0).text
        return {e: int(n) for e, n in re.findall(r'cache_config_info\{[^}]*engine="([^"]*)"[^}]*num_gpu_blocks="(\d+)"', text)}

    def counter(self, suffix: str) -> float:
        return (metric_sums(self.server.base_url, (suffix,)) or {}).get(suffix, 0.0)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.root + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    async def idle_leak(self) -> int:
        """Wait until no request is left anywhere; the KV blocks still in use then (0: none leaked)."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            busy = sum((await asyncio.to_thread(metric_sums, self.server.base_url,
                                                ("num_requests_running", "num_requests_waiting", "num_requests_awaiting_migration")) or {"?": 1}).values())
            usage = await asyncio.to_thread(self.gauges, "kv_cache_usage_perc")
            if (not busy and usage and not any(usage.values())) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        blocks = await asyncio.to_thread(self.num_blocks)
        return sum(round(usage.get(e, 1.0) * n) for e, n in blocks.items())

    def rss_by_process(self) -> dict[str, int]:
        """RSS (kB) of every process of the server, by ``process_name`` (a Ray worker's title changes with
        its task, so the name is read once per pid)."""
        return {name: mem["rss"] for name, mem in self.memory_by_process().items()}

    def memory_by_process(self) -> dict[str, dict[str, int]]:
        """Each server process's resident memory (kB), by ``process_name``: ``rss`` (all of it), ``anon`` (its
        private heap and stacks: what a leak grows), ``file`` (pages of mapped files — its binary and shared
        libraries, paged in as code runs for the first time and dropped by the kernel at will) and ``shmem``."""
        assert self.server.sid is not None
        fields = {"rss": "VmRSS", "anon": "RssAnon", "file": "RssFile", "shmem": "RssShmem"}
        out = {}
        for pid in session_pids(self.server.sid):
            try:
                status = open(f"/proc/{pid}/status").read()
            except OSError:
                continue
            mem = {key: int(m.group(1)) for key, field in fields.items() if (m := re.search(rf"{field}:\s+(\d+)", status))}
            if "rss" in mem:
                out[self.process_name(pid)] = mem
        return out

    def cpu_s_by_process(self) -> dict[str, float]:
        """CPU seconds (user + system) each server process alive now has used, by ``process_name``."""
        assert self.server.sid is not None
        tick, out = os.sysconf("SC_CLK_TCK"), {}
        for pid in session_pids(self.server.sid):
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out[self.process_name(pid)] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def process_name(self, pid: int) -> str:
        """``pid`` and what runs there: the actor's name for a Ray actor, else the program (``gcs_server``, ``raylet``...)."""
        if pid not in self._names:
            actors = {p: n for n, p in self.actor_pids().items()}
            try:
                argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            except OSError:
                argv = ["?"]
            program = os.path.basename(argv[0]) or "?"
            if program.startswith("python"):
                module = next((a for a in argv[1:] if not a.startswith("-")), "")
                program = f"python {os.path.basename(module)}"
            self._names[pid] = f"{pid} {actors.get(pid, program.split()[0] if program.startswith('ray::') else program)}"
        return self._names[pid]

    async def restart(self, extra_flags: list[str], env: dict[str, str] | None = None) -> None:
        """Stop the server (every process must exit) and start it again with ``extra_flags`` added and
        ``env`` (only) on top of this process's environment."""
        stop = await asyncio.to_thread(self.server.stop)
        self.figures.setdefault("restarts", []).append({"processes_left": stop["num_left"], "flags": extra_flags, **({"env": env} if env else {})})
        server = ServerProcess(self.server.name, self.server.argv + extra_flags, self.server.startup_timeout_s, env=dict(env or {}))
        self.servers.append(server)
        await asyncio.to_thread(server.start)
        print(f"server restarted with {' '.join(extra_flags)} in {server.startup_s:.1f} s", flush=True)
        self.server, self.root, self._names = server, server.base_url.removesuffix("/v1"), {}

    # ---- requests --------------------------------------------------------------------------------
    async def send(self, scenario: str, job: cc.Job, leave_after_first: bool = False) -> cc.Record:
        rec = self.ledger.add(scenario, job.kind)
        expected = None if leave_after_first else self.refs.get(job.key)
        return await cc.run_job(self.client, self.root, self.args.model, job, expected, rec, self.ledger, self.args.deadline, leave_after_first)

    async def new_requests_ok(self, scenario: str) -> bool:
        """After a row: one request of each kind, sent anew, completes with its reference."""
        jobs = cc.make_jobs(10, self.args.max_tokens, self.args.seed)
        probes = [jobs[0], jobs[1], jobs[9]]
        return all(r.outcome == "identical" for r in await asyncio.gather(*(self.send(f"{scenario} (after)", j) for j in probes)))

    def row(self, scenario: str, recovery_s: float | None, leaked: int, **extra: Any) -> dict[str, Any]:
        counts = self.ledger.counts(scenario)
        row = {"scenario": scenario, "sent": sum(counts.values()), "identical": counts["identical"], "error": counts["error"],
               "lost": sum(counts[o] for o in cc.LOST), "hung": counts["hung"], "disconnected": counts["disconnected"],
               "blocks_leaked": leaked, "recovery_s": None if recovery_s is None else round(recovery_s, 2), **extra}
        errors = sorted({(r.error or "")[:120] for r in self.ledger.records if r.scenario == scenario and r.error})
        row["errors"] = errors[:5]
        self.rows.append(row)
        print(f"{scenario}: {({k: v for k, v in row.items() if k != 'errors'})}", flush=True)
        for e in errors[:3]:
            print(f"  e.g. {e}", flush=True)
        return row

    async def wave(self, scenario: str, jobs: list[cc.Job], fault: Callable[[], Awaitable[Callable[[], bool]]] | None = None,
                   **extra: Any) -> dict[str, Any]:
        """Send ``jobs`` at once; ``fault`` (once a quarter of them stream) returns when it has recovered."""
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(self.send(scenario, job)) for job in jobs]
        recovery_s = None
        if fault is not None:
            quarter = max(1, len(jobs) // 4)
            while sum(r.first_s is not None for r in self.ledger.records if r.scenario == scenario) < quarter and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            t_fault = time.monotonic()
            recovered = await fault()
            while not await asyncio.to_thread(recovered) and time.monotonic() - t_fault < self.args.deadline:
                await asyncio.sleep(0.25)
            recovery_s = time.monotonic() - t_fault
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        leaked = await self.idle_leak()
        return self.row(scenario, recovery_s, leaked, wave_s=round(elapsed, 2), new_requests_ok=await self.new_requests_ok(scenario), **extra)

    # ---- faults ------------------------------------------------------------------------------------
    def fault(self, kind: str) -> Callable[[], Awaitable[Callable[[], bool]]]:
        names = {"decode-worker": ["Worker(decode-0 rank 1)"], "prefill-instance": ["InstanceServer(prefill-0)"],
                 "both": ["Worker(decode-0 rank 1)", "InstanceServer(prefill-0)"], "controller": ["ControllerActor"],
                 "stall-sender": ["InstanceServer(prefill-0)"], "stall-receiver": ["Worker(decode-0 rank 1)"]}[kind]

        async def inject() -> Callable[[], bool]:
            pids = self.actor_pids()
            targets = [pids[n] for n in names]
            if kind.startswith("stall"):
                for pid in targets:
                    os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(2.5 * self.args.kv_transfer_timeout)
                for pid in targets:
                    os.kill(pid, signal.SIGCONT)
                resumed = self.ledger.now()
                return lambda: any(r.end_s is not None and r.end_s > resumed and r.outcome == "identical" for r in self.ledger.records)
            restarts = self.counter("instance_restarts_total")
            for pid in targets:
                os.kill(pid, signal.SIGKILL)
            if kind == "controller":
                gone = pids["ControllerActor"]
                return lambda: self.healthy() and self.actor_pids().get("ControllerActor", gone) != gone and len(self.gauges("kv_cache_usage_perc")) == 2
            return lambda: self.counter("instance_restarts_total") >= restarts + len(targets) and self.healthy()

        return inject


async def scenarios(args: argparse.Namespace, servers: list[ServerProcess]) -> Run:
    async with cc.session() as client:
        run = Run(args, servers, client)
        jobs = cc.make_jobs(args.in_flight, args.max_tokens, args.seed)
        run.refs = await cc.references(run.client, run.root, args.model, args.dtype, jobs, run.ledger)
        base = await run.wave("fault-free", jobs)
        wave_rps = base["identical"] / base["wave_s"]  # requests/s completed with the whole wave in flight
        ttfts = sorted(r.first_s - r.sent_s for r in run.ledger.records if r.scenario == "fault-free" and r.first_s is not None)
        tpots = sorted((r.end_s - r.first_s) / max(1, args.max_tokens - 1) for r in run.ledger.records
                       if r.scenario == "fault-free" and r.first_s is not None and r.end_s is not None)
        slo = (args.ttft_slo, args.tpot_slo) if args.ttft_slo is not None else (2 * ttfts[int(0.9 * (len(ttfts) - 1))], 2 * tpots[int(0.9 * (len(tpots) - 1))])
        run.figures.update(wave_rps=round(wave_rps, 3), slo_ttft_s=round(slo[0], 3), slo_tpot_s=round(slo[1], 4))
        if args.planned_goodput is not None:
            goodput = args.planned_goodput
        else:
            goodput = await planned_goodput(run, slo, wave_rps) if {"soak", "overload"} & set(args.rows) else wave_rps
        run.figures["planned_goodput_rps"] = round(goodput, 3)
        if "faults" in args.rows:
            for kind in args.faults:
                if kind == "drop-sends":
                    await dropped_sends(run, jobs)
                else:
                    await run.wave(f"kill {kind}" if not kind.startswith("stall") else f"KV {kind}", jobs, run.fault(kind))
        if "kv" in args.rows:
            await kv_exhaustion(run, args.cache_tokens)
        if "storm" in args.rows:
            await storm(run)
        if "soak" in args.rows:  # on the server that went through every row above
            await soak(run, goodput, slo)
        if "overload" in args.rows:
            run.request_log = tempfile.mkstemp(prefix="chaos_overload_", suffix=".jsonl")[1]  # where the admitted requests' time went
            await run.restart(slo_flags(slo, args.tpot_share, args.queue_share) + ["--request-log", run.request_log])  # the deployment configured for the SLO measured above
            await overload(run, goodput, slo)
        if "shutdown" in args.rows:
            await shutdown(run)
        return run


def report(args: argparse.Namespace, run: Run) -> None:
    # Some rows only (--rows): chaos_ROW[_ROW...].*, beside the full report's chaos.*.
    out = harness.Outputs.for_run(args, "chaos", "" if set(args.rows) == set(ROWS) else "_".join(args.rows))
    rows = run.rows
    lines = [f"# Chaos suite: {args.model} ({args.dtype}), 1 prefill + 1 decode ({args.decode_parallel.upper()}=2) on the Ray runtime, "
             f"{os.cpu_count()} cores",
             "", f"Waves of {args.in_flight} requests in flight, {args.max_tokens} output tokens each; KV cache "
             f"{args.cache_tokens} tokens per instance; the fault-free wave completed {run.figures['wave_rps']} req/s"
             + (f"; planned goodput {run.figures['planned_goodput_rps']} req/s (measured: the highest Poisson rate with >= 90% "
                "within the SLO in every probe at it, row \"goodput search\")." if any(r["scenario"] == "goodput search" for r in rows) else "."), "",
             "| fault | requests sent | completed identical | ended with error | lost | hung | blocks leaked | recovery time (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['sent']} | {r['identical']} | {r['error']} | {r['lost']} | {r['hung']} | "
                     f"{r['blocks_leaked']} | {'-' if r['recovery_s'] is None else r['recovery_s']} |")
    soaked = next((r for r in rows if r["scenario"] == "soak 70%"), None)
    if soaked is not None:
        lines += ["", f"Soak: {soaked['rate_rps']} req/s for {soaked['duration_s']:g} s, SLO attainment {soaked.get('slo_attainment')} "
                  f"(no SLO flags on this server), worst RSS growth after warm-up {soaked['rss_max_growth']} ({soaked['rss_worst_process']}), "
                  f"worst growth of anonymous memory (heap and stacks) {soaked['anon_max_growth']} ({soaked['anon_worst_process']})."]
    kv = next((r for r in rows if r["scenario"] == "KV exhaustion: prompts together > cache"), None)
    if kv is not None:
        lines += ["", f"KV exhaustion: {kv['sent']} long prompts with {kv['max_tokens']} output tokens each, "
                  f"together over the cache; {kv['preemptions']} decodes preempted (their KV freed, recomputed later), "
                  f"{kv['identical']} completed identical."]
    drops = next((r for r in rows if r["scenario"] == "KV drop-sends"), None)
    if drops is not None:
        lines += ["", f"KV drop-sends: every {DROP_EVERY}th KV send of each worker lost on the wire; {drops['kv_migration_failures']} "
                  "migrations failed (the receiver timed out) and their requests were prefilled again."]
    over = next((r for r in rows if r["scenario"] == "overload 10x"), None)
    if over is not None:
        lines += ["", f"Overload 10x: {over['admitted']} admitted ({over['admitted_rps']} req/s of the burst, {over['admitted_share_of_planned']} "
                  f"of the planned goodput; {over['admitted_completion_rps']} req/s from the first admitted arrival to the last end, "
                  f"{over['admitted_completion_share_of_planned']}), {over['rejected_429']} refused with 429; queue bound {args.queue_share} of "
                  f"the TTFT SLO, decoding held to {args.tpot_share} of the TPOT SLO; "
                  f"admitted SLO attainment {over['admitted_slo_attainment']} (TTFT p90 {over['admitted_ttft_p90_s']} s vs "
                  f"{run.figures['slo_ttft_s']}, TPOT p90 {over['admitted_tpot_p90_s']} s vs {run.figures['slo_tpot_s']}); "
                  f"cores used: server {over['server_cpu_cores_used']}, load generator {over['client_cpu_cores_used']}."]
        if over.get("admitted_breakdown_s"):
            lines += ["", "Where the admitted requests' time went (the server's request log; p50 / p90 s):", "",
                      "| " + " | ".join(over["admitted_breakdown_s"]) + " |", "|" + "---:|" * len(over["admitted_breakdown_s"]),
                      "| " + " | ".join(f"{v['p50']} / {v['p90']}" for v in over["admitted_breakdown_s"].values()) + " |"]
    lines += ["", "Per row (JSON): " + str(out.path(".json").name) + "; every request: " + out.path("_ledger.json.gz").name]
    out.markdown(lines)
    out.json({"figures": run.figures, "rows": rows})
    with gzip.open(out.path("_ledger.json.gz"), "wt") as f:  # tens of thousands of records
        json.dump(run.ledger.dump(), f)
    print("\n".join(lines), flush=True)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally that stops the server
    from distserve.engine.weights import load_model

    config = load_model(args.model, args.dtype, weights=False).config
    kv_gb = args.cache_tokens * config.kv_bytes_per_token / (1 << 30)
    # The decode instance gets a second rank (a worker actor): TP=2 where the heads split in two, else PP=2 (SmolLM2's 9 heads).
    args.decode_parallel = "tp" if config.num_heads % 2 == 0 and config.num_kv_heads % 2 == 0 else "pp"
    flags = ["--runtime", "ray", "--prefill", "1", "--decode", "1", f"--decode-{args.decode_parallel}", "2", "--block-size", "16",
             "--kv-cache-gb", f"{kv_gb:.9f}", "--kv-transfer-timeout", str(args.kv_transfer_timeout),
             "--max-queued-requests", str(max(256, args.in_flight + 16, args.storm + 16))]  # every wave and the whole storm in flight
    servers = [ServerProcess("chaos", distserve_serve_argv(args.model, args.dtype, flags), args.startup_timeout)]
    t0 = time.monotonic()
    try:
        servers[0].start()
        print(f"server up in {servers[0].startup_s:.1f} s at {servers[0].base_url}", flush=True)
        run = asyncio.run(scenarios(args, servers))
    finally:
        stop = servers[-1].stop()
        if stop["num_left"]:
            print(f"WARNING: {stop['num_left']} server processes left after SIGKILL", file=sys.stderr)
    run.figures.update(model=args.model, quick=args.quick, decode_parallel=args.decode_parallel, in_flight=args.in_flight, tpot_share=args.tpot_share, queue_share=args.queue_share, duration_s=round(time.monotonic() - t0, 1),
                       rows={r["scenario"]: {k: v for k, v in r.items() if k not in ("scenario", "errors")} for r in run.rows},
                       total_lost=sum(r["lost"] for r in run.rows), total_hung=sum(r["hung"] for r in run.rows),
                       total_blocks_leaked=sum(r["blocks_leaked"] for r in run.rows))
    report(args, run)
    harness.finish(run.figures)


if __name__ == "__main__":
    main()
