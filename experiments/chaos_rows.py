"""The chaos suite's load rows (``experiments/chaos.py``): the planned goodput's search, overload at 10x it, the soak, KV
exhaustion, lost KV sends, the disconnect storm and graceful shutdown, each driving the server of a ``chaos.Run``."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import chaos_client as cc

from distserve.measure.benchserve import session_pids
from distserve.runtime.worker import TRANSFER_FAULTS_ENV

Run = Any  # ``chaos.Run`` (the script's; scripts import only shared modules)
DROP_EVERY = 5  # the drop-sends row: every n-th KV send of a worker is lost


# A semantic-variable program whose call was refused for overload ends with a 424 naming the refusal (QueueFullError's text).
REFUSED = ("requests in flight (max", "the admission queue holds", "(max_queue_delay)")


def refused(r: cc.Record) -> bool:
    """Refused for overload: a 429, or a program whose call got one."""
    return r.status == 429 or (r.outcome == "error" and any(m in (r.error or "") for m in REFUSED))


async def poisson(run: Run, scenario: str, rate: float, duration_s: float, on_tick: Callable[[], None]) -> list[cc.Record]:
    """Poisson arrivals at ``rate`` for ``duration_s``, sent on schedule (all that are due at once when behind,
    not paced by sleeps); ``on_tick`` about once a second."""
    args = run.args
    rng = random.Random(args.seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    jobs = cc.make_jobs(len(arrivals), args.max_tokens, args.seed + 1)
    tasks, t0, next_tick = [], time.monotonic(), 0.0
    for at, job in zip(arrivals, jobs):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        tasks.append(asyncio.ensure_future(run.send(scenario, job)))
        if at >= next_tick:
            on_tick()
            next_tick += 1.0
    return list(await asyncio.gather(*tasks))


GOODPUT_ATTAINMENT = 0.9  # DistServe's goodput: the highest rate at which this share of requests meets the SLO


async def planned_goodput(run: Run, slo: tuple[float, float], first_rate: float) -> float:
    """The planned goodput as DistServe defines it, measured on this server: the highest Poisson rate at which
    >= 90% of requests complete within ``slo``, searched by ``search_goodput`` with ``--goodput-probes`` probes of
    ``--goodput-probe-s`` each from ``first_rate`` (the fault-free wave's completion rate), a rate that passes
    repeated at once (``--goodput-confirmations`` repeats at most): the knee is a cliff — TPOT rises without bound once
    decoding falls behind — and one probe there passes or fails by luck (15 req/s: 1.0, then 0.64 with the same arrivals).
    Every request of every probe is in the row "goodput search" (lost, hung, leaked counted as in any row); the row
    says ``bracketed: false`` if no probe passed, ``confirmed: false`` if the rate used did not pass a repeat."""
    args = run.args
    run.refs.update(await cc.references(run.client, run.root, args.model, args.dtype,
                                        cc.make_jobs(20, args.max_tokens, args.seed + 1), run.ledger))  # the Poisson rows' prompts
    probes: list[dict] = []
    leaked = 0

    async def probe(rate: float, repeat: bool) -> bool:
        nonlocal leaked
        sent = await poisson(run, "goodput search", rate, args.goodput_probe_s, lambda: None)
        attainment = slo_attainment(sent, slo, args.max_tokens) or 0.0
        probes.append({"rate_rps": round(rate, 3), "sent": len(sent), "slo_attainment": attainment, "repeat": repeat})
        print(f"  goodput probe{' (repeat)' if repeat else ''} at {rate:.2f} req/s: {attainment:.3f} within the SLO", flush=True)
        leaked = max(leaked, await run.idle_leak())  # and the next probe starts on an idle server
        return attainment >= GOODPUT_ATTAINMENT

    goodput, bracketed, confirmed = await search_goodput(probe, first_rate, args.goodput_probes, args.goodput_confirmations)
    run.row("goodput search", None, leaked, planned_goodput_rps=round(goodput, 3), bracketed=bracketed, confirmed=confirmed,
            first_rate_rps=round(first_rate, 3), probes=probes)
    return goodput


async def search_goodput(probe: Callable[[float, bool], Awaitable[bool]], first_rate: float, probes: int,
                         confirmations: int) -> tuple[float, bool, bool]:
    """(goodput, bracketed, confirmed): ``probes`` calls of ``probe(rate, repeat=False)`` from ``first_rate``, up by
    1.5x while they pass, down by 1.5x while none has, then bisecting between the highest rate that passed and the
    lowest that failed. A probe that passes is repeated at once (``probe(rate, repeat=True)``, at most
    ``confirmations`` repeats in all), and the rate counts as passed only if the repeat passes too: near the knee
    one probe passes by luck. ``bracketed``: some rate passed (else the goodput is the lowest rate probed over
    1.5); ``confirmed``: the rate returned passed its repeat (or no repeat was asked for)."""
    # Each rate probed is above every rate that passed and below every one that failed, so the last pass is the best.
    best, best_repeated, failed, rate, repeats_left = None, False, None, first_rate, confirmations
    for _ in range(probes):
        ok, repeated = await probe(rate, False), False
        if ok and repeats_left > 0:
            repeats_left -= 1
            ok, repeated = await probe(rate, True), True
        if ok:
            best, best_repeated = rate, repeated
        else:
            failed = rate
        if failed is None:
            rate *= 1.5
        elif best is None:
            rate = failed / 1.5
        else:
            rate = (best + failed) / 2
    if best is None:
        assert failed is not None  # probes >= 1, none passed
        return failed / 1.5, False, False  # failed: the lowest rate probed
    return best, True, confirmations == 0 or best_repeated


def slo_flags(slo: tuple[float, float], tpot_share: float, queue_share: float) -> list[str]:
    """The server's configuration for its SLO: the admission queue refuses a request predicted to wait
    more than ``queue_share`` of the TTFT SLO (the rest for the prefill, its wait on the instance and the
    KV migration), and backpressure holds requests while decoding is slower than ``tpot_share`` of the
    TPOT SLO (the rest: headroom for the steps of the requests already admitted)."""
    return ["--ttft-slo", f"{slo[0]:.3f}", "--tpot-slo", f"{slo[1] * tpot_share:.4f}", "--tpot-backpressure",
            "--max-queue-delay", f"{slo[0] * queue_share:.3f}"]


async def overload(run: Run, goodput: float, slo: tuple[float, float]) -> None:
    """Poisson arrivals at 10x the planned goodput: refusals are 429s with Retry-After, admitted requests meet the
    SLO, memory stays bounded, and latency is back to normal within seconds once the burst has drained."""
    args = run.args
    run.refs.update(await cc.references(run.client, run.root, args.model, args.dtype,
                                        cc.make_jobs(20, args.max_tokens, args.seed + 1), run.ledger))
    idle_ttft = await single_ttft(run)
    rss: list[int] = []
    base_rss = sum(run.rss_by_process().values())
    cpu0, client0, wall0 = run.cpu_s_by_process(), time.process_time(), time.monotonic()
    burst = await poisson(run, "overload 10x", 10 * goodput, args.overload_s, lambda: rss.append(sum(run.rss_by_process().values())))
    # Who had the machine's cores during the burst: the load generator (this process) shares them with the server.
    cpu1, cpu_client, wall = run.cpu_s_by_process(), time.process_time() - client0, time.monotonic() - wall0
    cores_by_process = {p: round((cpu1[p] - cpu0.get(p, 0.0)) / wall, 2) for p in cpu1}
    cpu_server = sum(cpu1.values()) - sum(cpu0.get(p, 0.0) for p in cpu1)
    drained = time.monotonic()  # the burst's admitted requests have all ended
    last_arrival = max((r.sent_s for r in burst), default=0.0)
    drain_s = max((r.end_s or 0.0 for r in burst), default=0.0) - last_arrival
    back_s = None
    while time.monotonic() - drained < 120:
        ttft = await single_ttft(run)
        if ttft is not None and ttft <= 2 * idle_ttft:
            back_s = time.monotonic() - drained
            break
        await asyncio.sleep(0.5)
    rejected = [r for r in burst if r.status == 429]
    admitted = [r for r in burst if not refused(r)]
    # The admitted rate as the planned goodput is measured: requests arriving per second of the burst (a probe's rate
    # is its arrivals per second of the probe, the backlog it leaves at the end included). Also, for the record, the
    # admitted requests per second from the first one's arrival to the last one's end (the burst's drain included).
    span = max((r.end_s or 0.0 for r in admitted), default=0.0) - min((r.sent_s for r in admitted), default=0.0)
    within = [r for r in admitted if meets_slo(r, slo, args.max_tokens)]
    leaked = await run.idle_leak()
    run.row("overload 10x", back_s, leaked, rate_rps=round(10 * goodput, 2), drain_s=round(drain_s, 2), admitted=len(admitted),
            admitted_rps=round(len(admitted) / args.overload_s, 3),
            admitted_share_of_planned=round(len(admitted) / args.overload_s / goodput, 3) if goodput > 0 else None,
            admitted_within_slo_rps=round(len(within) / args.overload_s, 3),
            admitted_completion_rps=round(len(admitted) / span, 3) if span > 0 else None,
            admitted_completion_share_of_planned=round(len(admitted) / span / goodput, 3) if span > 0 and goodput > 0 else None,
            rejected_429=len(rejected),
            rejected_with_retry_after=sum(r.retry_after is not None for r in rejected),
            programs_refused=sum(r.status != 429 and refused(r) for r in burst),
            admitted_slo_attainment=slo_attainment(admitted, slo, args.max_tokens),
            admitted_ttft_p90_s=_p90([r.first_s - r.sent_s for r in admitted if r.first_s is not None]),
            admitted_tpot_p90_s=_p90([(r.end_s - r.first_s) / max(1, args.max_tokens - 1) for r in admitted
                                      if r.first_s is not None and r.end_s is not None]),
            cpu_cores=os.cpu_count(), server_cpu_cores_used=round(cpu_server / wall, 2), client_cpu_cores_used=round(cpu_client / wall, 2),
            server_cores_by_process=dict(sorted(cores_by_process.items(), key=lambda kv: -kv[1])),
            rss_mb_before=round(base_rss / 1024), rss_mb_max=round(max(rss, default=base_rss) / 1024),
            admitted_breakdown_s=breakdown_percentiles(run.request_log),
            new_requests_ok=await run.new_requests_ok("overload 10x"))


def breakdown_percentiles(request_log: str | None) -> dict[str, dict[str, float]] | None:
    """p50 / p90 of each part of the server's latency breakdown (queueing, prefill, waiting for a decode
    instance, KV migration, decode: DistServe's Figure 10) over the requests of the server's log that
    finished with their tokens."""
    if request_log is None or not os.path.exists(request_log):
        return None
    with open(request_log, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    parts: dict[str, list[float]] = {}
    for rec in records:
        if rec.get("finish_reason") in ("length", "stop") and rec.get("breakdown"):
            for name, value in rec["breakdown"].items():
                if value is not None:
                    parts.setdefault(name, []).append(value)
    return {name: {"p50": round(_pct(v, 0.5), 3), "p90": round(_pct(v, 0.9), 3), "n": len(v)} for name, v in parts.items()} or None


def meets_slo(r: cc.Record, slo: tuple[float, float], max_tokens: int) -> bool:
    """Whether ``r`` completed with its reference text within the (TTFT, TPOT) ``slo``."""
    return (r.outcome == "identical" and r.first_s is not None and r.end_s is not None
            and r.first_s - r.sent_s <= slo[0] and (r.end_s - r.first_s) / max(1, max_tokens - 1) <= slo[1])


def slo_attainment(records: list[cc.Record], slo: tuple[float, float], max_tokens: int) -> float | None:
    """The share of ``records`` that completed with their reference text within the (TTFT, TPOT) ``slo``."""
    return round(sum(meets_slo(r, slo, max_tokens) for r in records) / len(records), 3) if records else None


async def soak(run: Run, goodput: float, slo: tuple[float, float]) -> None:
    """Poisson arrivals at 70% of the planned goodput for --soak-s: memory of every process after warm-up (a quarter
    in) vs at the end — all of its RSS, and its anonymous part alone (heap and stacks: what a leak grows; the rest
    is mostly pages of its binary and libraries, paged in when a code path first runs) — and the share of requests
    within the SLO (this server runs without SLO flags: nothing is refused)."""
    args = run.args
    samples: list[dict[str, dict[str, int]]] = []
    sent = await poisson(run, "soak 70%", 0.7 * goodput, args.soak_s, lambda: samples.append(run.memory_by_process()))
    warm = samples[len(samples) // 4] if samples else {}
    end = run.memory_by_process()

    def growth(kind: str) -> dict[str, float]:
        return {p: (end[p][kind] - warm[p][kind]) / warm[p][kind] for p in warm
                if p in end and warm[p].get(kind, 0) > 0 and kind in end[p]}

    rss, anon = growth("rss"), growth("anon")
    # Each process's anonymous memory (MB) every tenth of the soak: a leak grows at a steady rate to the end,
    # a heap that is filling its allocator's free lists levels off.
    step = max(1, len(samples) // 10)
    series = {p: [round(sample[p]["anon"] / 1024, 1) for sample in samples[::step] if p in sample and "anon" in sample[p]] for p in end}
    worst = max(rss, key=lambda p: rss[p], default=None)
    worst_anon = max(anon, key=lambda p: anon[p], default=None)
    run.row("soak 70%", None, await run.idle_leak(), rate_rps=round(0.7 * goodput, 2), duration_s=args.soak_s,
            rss_max_growth=round(rss[worst], 4) if worst else None, rss_worst_process=worst,
            anon_max_growth=round(anon[worst_anon], 4) if worst_anon else None, anon_worst_process=worst_anon,
            rss_growth_by_process={p: round(g, 4) for p, g in sorted(rss.items(), key=lambda kv: -kv[1])},
            anon_growth_by_process={p: round(g, 4) for p, g in sorted(anon.items(), key=lambda kv: -kv[1])},
            memory_kb_after_warmup=warm, memory_kb_at_end=end, anon_mb_every_tenth=series,
            rss_mb_at_end={p: round(m["rss"] / 1024) for p, m in end.items()}, slo_attainment=slo_attainment(sent, slo, args.max_tokens),
            new_requests_ok=await run.new_requests_ok("soak 70%"))


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def _p90(values: list[float]) -> float | None:
    return round(_pct(values, 0.9), 3) if values else None


async def dropped_sends(run: Run, jobs: list[cc.Job]) -> None:
    """KV transfers lost on the wire, all through a wave: a server whose workers drop every ``DROP_EVERY``-th KV
    send (``DISTSERVE_TRANSFER_FAULTS``); the row counts the migrations that failed (each request prefilled again).
    The server is then restarted without it for the rows that follow."""
    await run.restart([], env={TRANSFER_FAULTS_ENV: f"drop_send:{DROP_EVERY}"})
    row = await run.wave("KV drop-sends", jobs)
    row["kv_migration_failures"] = int(run.counter("kv_migration_failures_total"))
    print(f"  KV migrations that failed and were prefilled again: {row['kv_migration_failures']}", flush=True)
    await run.restart([])


async def single_ttft(run: Run) -> float | None:
    """TTFT of one short completion (None if it failed)."""
    rec = await run.send("latency probe", cc.Job("completion", "Latency probe", 2))
    return rec.first_s - rec.sent_s if rec.outcome == "identical" and rec.first_s is not None else None


KV_OUTPUT_FACTOR = 4  # the KV exhaustion row's outputs, in --max-tokens: long enough that running decodes outgrow the cache
# Its prompts' lengths in words: SmolLM2 ~100 tokens (~1/40 of the cache), the tiny model's tokenizer ~50 (~1/15 of the
# --quick cache): many resident at once, so their outputs outgrow the cache.
KV_PROMPT_WORDS, KV_PROMPT_WORDS_QUICK = (40, 80), (8, 16)


async def kv_exhaustion(run: Run, cache_tokens: int) -> None:
    """Long prompts (``KV_PROMPT_WORDS``: each a small share of the cache, so that many are resident at once) that
    together exceed the cache, with outputs ``KV_OUTPUT_FACTOR`` times the waves' (a decode
    instance admits a migration when its prompt fits, so only outputs growing into a full cache make it preempt:
    with the waves' 16 tokens no run ever did), every one to complete identical (``preemptions``: decodes
    preempted and recomputed); then one prompt larger than the whole cache, refused with 400 at admission."""
    args = run.args
    preempted = run.counter("num_preemptions_total")
    max_tokens, words = KV_OUTPUT_FACTOR * args.max_tokens, KV_PROMPT_WORDS_QUICK if args.quick else KV_PROMPT_WORDS
    long_jobs = [j for j in cc.make_jobs(args.in_flight, max_tokens, args.seed + 2, num_prompts=args.in_flight, words=words)
                 if j.kind != "dataflow"]
    run.refs.update(await cc.references(run.client, run.root, args.model, args.dtype, long_jobs, run.ledger))
    row = await run.wave("KV exhaustion: prompts together > cache", long_jobs)
    row.update(max_tokens=max_tokens, preemptions=int(run.counter("num_preemptions_total") - preempted))  # after the wave
    words = " ".join(["word"] * cache_tokens)  # at least one token per word, with any tokenizer here
    rec = await run.send("KV exhaustion: one prompt > cache", cc.Job("completion", words, 4))
    run.row("KV exhaustion: one prompt > cache", None, await run.idle_leak(), status=rec.status, refused_at_admission=rec.status == 400)


async def storm(run: Run) -> None:
    # --storm clients, each a chat or completion stream (a dataflow program's variable outlives its reader by design).
    jobs = [j for j in cc.make_jobs(2 * run.args.storm, 64, run.args.seed + 3) if j.kind != "dataflow"][: run.args.storm]
    await asyncio.gather(*(run.send("disconnect storm", j, leave_after_first=True) for j in jobs))
    run.row("disconnect storm", None, await run.idle_leak(), new_requests_ok=await run.new_requests_ok("disconnect storm"))


async def shutdown(run: Run) -> None:
    """SIGTERM with a wave in flight: it must end (complete, or fail clearly once --shutdown-grace is over), new
    requests get 503 with Retry-After, and no process is left."""
    jobs = cc.make_jobs(run.args.in_flight, run.args.max_tokens, run.args.seed)
    tasks = [asyncio.ensure_future(run.send("graceful shutdown", j)) for j in jobs]
    while sum(r.first_s is not None for r in run.ledger.records if r.scenario == "graceful shutdown") < len(jobs) // 4:
        await asyncio.sleep(0.05)
    assert run.server.proc is not None
    t0 = time.monotonic()
    run.server.proc.send_signal(signal.SIGTERM)
    # The late request goes out once the server is draining (every route answers 503 then), while the wave is still
    # in flight: a fixed wait could outlast a short drain, and then the request finds the port closed.
    while time.monotonic() - t0 < 5 and await asyncio.to_thread(run.healthy):
        await asyncio.sleep(0.01)
    late = await run.send("graceful shutdown (after SIGTERM)", jobs[0])
    await asyncio.gather(*tasks)
    try:
        await asyncio.to_thread(run.server.proc.wait, 60)
    except Exception:  # noqa: BLE001 - reported as not exited
        pass
    exit_s = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while session_pids(run.server.sid or 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    left = len(session_pids(run.server.sid or 0))
    run.row("graceful shutdown", exit_s, 0, exit_code=run.server.proc.returncode, processes_left=left,
            new_request_refused=late.outcome == "error" and late.status == 503 and late.retry_after is not None)
