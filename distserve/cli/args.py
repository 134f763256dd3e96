"""The ``distserve`` command line's arguments: the parser, flag types, and turning placement flags into a ``Placement``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.cli.arg_types import fraction, positive_float, positive_int
from distserve.cluster.admission import DEFAULT_MAX_WAITING, DEFAULT_WAITING_UNIT, WAITING_UNITS
from distserve.cluster.fair_queue import ADMISSION_POLICIES, DEFAULT_ADMISSION_POLICY
from distserve.cluster.routing import DEFAULT_ROUTER, ROUTERS
from distserve.dataflow.limits import DEFAULT_LIMITS
from distserve.dtypes import DTYPE_BYTES
from distserve.engine.step_budget import STEP_POLICIES
from distserve.errors import DistServeError
from distserve.runtime.config import SERVER_MAX_QUEUED_REQUESTS
from distserve.serving.metrics_exposition import METRICS_PREFIXES, OWN_PREFIX

if TYPE_CHECKING:
    from distserve.cluster.admission import AdmissionConfig
    from distserve.cluster.tenants import TenantSpec
    from distserve.placement import Placement


LATENCY_HELP = "200ms, 0.2s or 0.2 (a bare number is seconds; above 60 it is refused as a likely millisecond value)"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="tiny | smollm2-135m | HF folder | .gguf file")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_BYTES],
        help="auto: bfloat16 on CUDA or CPUs with AMX/AVX512-BF16, else float32",
    )
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="memory for the paged KV cache")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--decode-attention",
        default=None,
        choices=["padded", "exact", "cascade", "triton", "flashinfer"],
        help="decode-attention backend (default: cascade on CPU — shared prompt prefixes read once per batch when it pays)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")


# ``distserve plan --workers``: searches with any number of workers give the one-process plan (``planner/chains.py``);
# 2 measured faster than 1 on 2 cores for large and small plans alike; more than 2 not measured.
DEFAULT_PLAN_WORKERS = min(2, os.cpu_count() or 1)


def _token_count(text: str) -> int:
    """A positive token count, also as vLLM writes them: ``32k`` (x1000), ``32K`` (x1024), ``1m``, ``1M``."""
    units = {"k": 1000, "K": 1024, "m": 10**6, "M": 2**20}
    try:
        value = int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of tokens (e.g. 4096 or 4k), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _string_list(text: str) -> tuple[str, ...]:
    from distserve.serving.cors import parse_list

    try:
        return parse_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings or comma-separated values: {exc}") from None


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--colocated", type=positive_int, default=None, metavar="N", help="N colocated engines instead of xPyD")
    p.add_argument("--prefill", type=positive_int, default=None, metavar="N", help="prefill instances (default 1)")
    p.add_argument("--decode", type=positive_int, default=None, metavar="M", help="decode instances (default 1)")
    for phase in ("prefill", "decode"):
        for kind, what in (("tp", "tensor"), ("pp", "pipeline")):
            p.add_argument(f"--{phase}-{kind}", type=positive_int, default=1, help=f"{what}-parallel degree of {phase}")
    p.add_argument("--placement", default=None, metavar="FILE", help="a Placement JSON (from `distserve plan`)")
    p.add_argument("--router", default=DEFAULT_ROUTER, choices=sorted(ROUTERS),
                   help="how a new request's entry instance is chosen: prefix-affinity (the longest cached prefix among the "
                   "least loaded) or least-loaded")


def latency_type(flag: str, *, allow_inf: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a latency flag: ``200ms``, ``0.2s`` or ``0.2`` -> seconds (``distserve.slo.parse_latency``)."""
    from distserve.errors import InvalidConfigError
    from distserve.slo import parse_latency

    def parse(text: str) -> float:
        try:
            return parse_latency(text, flag, allow_inf=allow_inf)
        except InvalidConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None

    parse.__name__ = "latency"
    return parse


def _add_admission_args(p: argparse.ArgumentParser, tpot_flag: str) -> None:
    p.add_argument("--admission-policy", default=DEFAULT_ADMISSION_POLICY, choices=sorted(ADMISSION_POLICIES),
                   help="order of the admission queue: fair (weighted fair queueing by tokens across tenants, strict tiers; "
                   "default), fcfs (arrival order), priority (tier, objective, priority, arrival)")
    p.add_argument("--waiting-unit", default=DEFAULT_WAITING_UNIT, choices=WAITING_UNITS,
                   help="backpressure: an entry instance takes a request while the prompt tokens waiting there ahead of it fit "
                   "one step (tokens, the default), or while fewer than --max-waiting requests wait there (requests: TNG's rule); "
                   "the rest wait in the fair queues, where they can still be reordered")
    p.add_argument("--max-waiting", type=positive_int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help=f"with --waiting-unit requests: requests that may wait in an entry instance (default {DEFAULT_MAX_WAITING}, TNG's)")
    p.add_argument("--no-backpressure", action="store_true", help="dispatch every request on arrival (no admission queueing)")
    p.add_argument("--tpot-backpressure", action="store_true",
                   help=f"backpressure also holds requests while the measured decode TPOT exceeds {tpot_flag} and, "
                   "disaggregated, while the decode instances' free KV cannot hold the prompts the prefill instances already "
                   "have (a prefilled request with nowhere to decode waits after its first token, against its TPOT), or more "
                   "requests than the decode instances' measured time per token leaves room for (the decode headroom)")
    p.add_argument("--max-queue-delay", type=latency_type("--max-queue-delay"), default=None, metavar="LATENCY",
                   help="refuse at once (429 with Retry-After) a request whose predicted wait in the admission queue (the requests "
                   f"ahead of it, at the rate the queue drains while backlogged) exceeds LATENCY ({LATENCY_HELP}), and end with a 429 "
                   "any request that has waited that long there; e.g. part of the TTFT SLO, so that under overload the admitted "
                   "requests still meet it (default: no bound)")


def admission_config_of(args: argparse.Namespace, tpot_slo_s: float | None, tenants: tuple["TenantSpec", ...] = ()) -> "AdmissionConfig":
    """The ``AdmissionConfig`` of the admission flags (``tpot_slo_s``: the SLO --tpot-backpressure holds to)."""
    from distserve.cluster.admission import AdmissionConfig
    from distserve.errors import InvalidConfigError

    if args.tpot_backpressure and tpot_slo_s is None and not args.no_backpressure:
        raise InvalidConfigError("--tpot-backpressure needs a TPOT SLO (--tpot-slo, or a placement that carries one)")
    return AdmissionConfig(
        args.admission_policy, tenants, max_waiting=None if args.no_backpressure else args.max_waiting,
        tpot_slo_s=tpot_slo_s if args.tpot_backpressure and not args.no_backpressure else None, waiting_unit=args.waiting_unit,
        max_queue_delay_s=args.max_queue_delay)


def _add_colocated_policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--colocated-policy", default="mixed", choices=list(STEP_POLICIES),
                   help="colocated step composition: mixed (prompts join the decodes' step, ours) or vllm-2023 (a step that "
                   "admits prompts runs only them, whole; decodes pause: the vLLM DistServe compared against)")


def _add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a known HF id (facebook/opt-13b, ...), alias, or config.json path")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="latency profile JSON (`distserve profile`, or DistServe's coefficients); default: roofline model")
    p.add_argument("--hardware", default=None, help="a100-80g | h100-sxm | h200 | l40s | cpu (default: the profile's, else a100-80g)")
    _add_placement_args(p)
    p.add_argument("--workload", default="chatbot",
                   help="chatbot | code | summarization | sharegpt-multiturn | humaneval | longbench (DistServe's datasets) | fixed:P:O | flood[:N[:FACTOR]] (one tenant flooding at FACTOR x the "
                   "rate of each of N chat tenants, default 3 and 10) | mix:OBJECTIVE=LENGTHS[:FRACTION],... (requests of several "
                   "scheduling classes, e.g. mix:latency=chatbot:0.3,throughput=summarization) | trace.jsonl (with a \"tenant\" field: several tenants)")
    p.add_argument("--rate", type=positive_float, default=None, help="arrival rate, requests/s (a trace is rescaled to it)")
    p.add_argument("--num-requests", type=positive_int, default=1000, help="requests of a synthetic workload")
    _add_admission_args(p, "--tpot")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "fixed"], help="arrival process")
    p.add_argument("--cv", type=positive_float, default=1.0, help="coefficient of variation of gamma inter-arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft", "--ttft-slo", dest="ttft", type=latency_type("--ttft"), required=True, help=f"TTFT SLO: {LATENCY_HELP}")
    p.add_argument("--tpot", "--tpot-slo", dest="tpot", type=latency_type("--tpot"), required=True, help=f"TPOT SLO: {LATENCY_HELP}")
    p.add_argument("--attainment", type=fraction, default=0.9, help="fraction of requests that must meet the SLO")
    p.add_argument("--attainment-mode", default="joint", choices=["joint", "separate"],
                   help="joint: a request must meet both SLOs; separate: each SLO on its own fraction (DistServe's 90%%/90%%)")
    p.add_argument("--goodput", action="store_true", help="also search the highest rate meeting the SLO (bisection)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per batch (default: as serve)")
    p.add_argument("--max-batched-tokens", type=positive_int, default=None, help="tokens per step (default: as serve)")
    p.add_argument("--num-blocks", type=positive_int, default=None, help="KV blocks per instance (default: what fits)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0, help="extra fixed cost per step of the runtime")
    p.add_argument("--step-budget", default="static", choices=["static", "slo"],
                   help="colocated/decode step budget: static (whole prompts) or slo (chunk prompts to keep steps within --tpot, "
                   "as serve --tpot-slo does)")
    _add_colocated_policy_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a known HF id (facebook/opt-13b, meta-llama/Llama-3.1-8B, ...) or a config.json path")
    p.add_argument("--gpu", default="a100-80g", help="a100-80g | h100-sxm | h200 | l40s | cpu (this machine, measured)")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--intra-node-bandwidth", type=positive_float, default=None, metavar="GB/s", help="override the GPU's NVLink/PCIe bandwidth")
    p.add_argument("--inter-node-bandwidth", type=positive_float, default=None, metavar="GB/s", help="override the network bandwidth per GPU")
    p.add_argument("--workload", default="chatbot",
                   help="chatbot | code | summarization | sharegpt-multiturn | humaneval | longbench | fixed:P:O | trace.jsonl (its 'objective' field: a request's class) | "
                   "mix:OBJECTIVE=LENGTHS[:FRACTION],... a mix of classes, e.g. mix:latency=chatbot:0.3,throughput=summarization")
    p.add_argument("--num-requests", type=positive_int, default=300, help="requests simulated per probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft", "--ttft-slo", dest="ttft", type=latency_type("--ttft"), default=None,
                   help=f"TTFT SLO: {LATENCY_HELP} (default: the strictest --class-slo)")
    p.add_argument("--tpot", "--tpot-slo", dest="tpot", type=latency_type("--tpot"), default=None,
                   help=f"TPOT SLO: {LATENCY_HELP} (default: the strictest --class-slo)")
    p.add_argument("--class-slo", action="append", default=None, metavar="OBJECTIVE=TTFT:TPOT",
                   help="SLO of one request class (its objective: latency, throughput, default), latencies as --ttft (inf: not "
                   "checked), e.g. latency=200ms:50ms, repeatable; with two or "
                   "more classes the best disaggregated plan is also weighed split into per-class decode pools, and with larger batch caps")
    p.add_argument("--attainment", type=fraction, default=0.9)
    p.add_argument("--attainment-mode", default="joint", choices=["joint", "separate"])
    p.add_argument("--rate", type=positive_float, default=None, help="target traffic (req/s): size the plan for it")
    p.add_argument("--gpus", type=positive_int, default=None, help="GPU budget (default: the whole cluster)")
    p.add_argument("--profile", default=None, metavar="FILE", help="latency profile JSON (default: roofline model of --gpu)")
    p.add_argument("--affinity", default="auto", choices=["high", "low", "auto"],
                   help="high: KV may cross nodes; low: prefill and decode of a stage share a node; auto: both")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per batch (default: as serve)")
    p.add_argument("--max-batched-tokens", type=positive_int, default=None, help="tokens per step (default: as serve)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0, help="extra fixed cost per step of the runtime (see validate_simulator)")
    p.add_argument("--workers", type=positive_int, default=DEFAULT_PLAN_WORKERS,
                   help=f"processes simulating candidates in parallel; any number gives the same plan (default {DEFAULT_PLAN_WORKERS}: "
                   "this machine's cores, at most 2 — measured: the README's OPT-66B plan 3.9 s -> 2.5 s end to end on 2 cores)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the best Placement JSON here")
    p.add_argument("--plot", default=None, metavar="PNG", help="attainment vs rate of the best disaggregated and colocated plans")
    p.add_argument("--save-dir", default=None, metavar="DIR",
                   help="write the plan's bundle here: placement.json, candidates.csv (every candidate), attainment.png, goodput.png, "
                   "serve_command.txt (the `distserve serve` command) and serve_config.yaml (Ray Serve: `serve run serve_config.yaml`)")
    _add_colocated_policy_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--max-queued-requests", type=positive_int, default=SERVER_MAX_QUEUED_REQUESTS, help="requests in flight before 429")
    _add_placement_args(p)
    p.add_argument(
        "--runtime",
        default="auto",
        choices=["auto", "ray", "local"],
        help="ray: every instance in its own Ray actor(s), KV over torch.distributed; local: all instances in "
        "this process; auto: ray when a TP/PP degree > 1 or --placement is given, else local",
    )
    p.add_argument("--kv-transfer-timeout", type=positive_float, default=None, metavar="S",
                   help="seconds before a KV migration is failed and the request re-prefilled (Ray runtime; default 30)")
    p.add_argument("--shutdown-grace", type=positive_float, default=None, metavar="S",
                   help="on SIGINT/SIGTERM: seconds requests in flight get to finish before the rest are failed with an error "
                   "(new connections are refused at once; default 10)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch threads per engine (local runtime; default: all cores) or per Ray worker "
                   "(default: the placement's per-instance threads, else 1)")
    p.add_argument("--ttft-slo", type=latency_type("--ttft-slo"), default=None, metavar="LATENCY",
                   help=f"TTFT SLO ({LATENCY_HELP}): /metrics counts requests meeting the SLO (default: the placement's)")
    p.add_argument("--tpot-slo", type=latency_type("--tpot-slo"), default=None, metavar="LATENCY",
                   help=f"TPOT SLO ({LATENCY_HELP}): colocated and decode steps chunk prompts to stay within it "
                   "(the 'slo' step budget; default: the placement's, else whole prompts per step)")
    p.add_argument("--session-ttl", type=positive_float, default=DEFAULT_LIMITS.ttl_s, metavar="S",
                   help="semantic-variable sessions idle this long are ended, their calls aborted")
    p.add_argument("--max-sessions", type=positive_int, default=DEFAULT_LIMITS.max_sessions, metavar="N", help="live sessions before 429")
    p.add_argument("--max-variables", type=positive_int, default=DEFAULT_LIMITS.max_variables, metavar="N", help="variables per session before 429")
    p.add_argument("--max-pending-calls", type=positive_int, default=DEFAULT_LIMITS.max_pending_calls, metavar="N",
                   help="unfinished semantic calls per session before 429")
    p.add_argument("--max-value-chars", type=positive_int, default=DEFAULT_LIMITS.max_value_chars, metavar="N",
                   help="characters of a variable's value, a literal input or a template before 413")
    p.add_argument("--parrot-unauthenticated-calls", action="store_true",
                   help="accept semantic calls that carry a session id but no session_auth, as Parrot's released "
                   "frontend sends them (every other route still checks the token; a wrong token is still refused)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="YAML/JSON key file (tenants: weight, tier, limits; keys: key -> tenant): every route but /health and "
                   "/metrics then needs `Authorization: Bearer <key>` (401 otherwise) and a tenant sees only its own sessions")
    _add_admission_args(p, "--tpot-slo")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="TOKENS",
                   help="prefill instances compute prompts in chunks of at most TOKENS per step (chunked prefill), so a light "
                   "tenant's prompt waits for one chunk rather than a whole long prompt (default: whole prompts, 2048 tokens per step)")
    p.add_argument("--no-layer-preemption", action="store_true",
                   help="run every step whole; by default a prefill instance's plan of a backlogged tenant's prompts yields "
                   "between layers to a sparse tenant's or a higher tier's prompt arriving meanwhile (and, in-process, a decode "
                   "step yields to the prefill of a new request)")
    p.add_argument("--request-log", default=None, metavar="FILE.jsonl",
                   help="append one JSON line per finished request (id, tenant, tokens, every timestamp and the latency breakdown: "
                   "queueing, prefill, migration, decode)")
    p.add_argument("--metrics-prefix", default=OWN_PREFIX, choices=METRICS_PREFIXES,
                   help="/metrics names the series vLLM also exports <prefix>:<vLLM's name> (vllm: vLLM's own Grafana dashboard "
                   "reads them unchanged); distserve's own series stay distserve:")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"], metavar="NAME",
                   help="parse tool calls out of chat completions (vLLM's names; hermes: <tool_call>{json}</tool_call>)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='accept tool_choice "auto" (the default when a request has tools): calls in the output come back as '
                   "tool_calls (needs --tool-call-parser, as in vLLM)")
    from distserve.engine.grammar_backends import STRUCTURED_OUTPUT_BACKENDS

    p.add_argument("--structured-output-backend", default=None, choices=sorted(STRUCTURED_OUTPUT_BACKENDS), metavar="NAME",
                   help="grammar library for response_format / guided_* / forced tool calls (llguidance (default) or xgrammar; "
                   "see experiments/results/bench_structured_output.md)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's (vLLM's flag)")
    p.add_argument("--max-model-len", type=_token_count, default=None, metavar="TOKENS",
                   help="context length: prompt + output tokens of a request (default: the placement's, else the model's)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, metavar="N",
                   help="sequences per batch of every instance (default: the placement's, else 64); an instance's own cap "
                   "in the Placement JSON still applies to it")
    p.add_argument("--max-num-batched-tokens", type=_token_count, default=None, metavar="TOKENS",
                   help="tokens per step of every instance (default: the placement's, else 2048; --prefill-chunk sets "
                   "prefill instances' own)")
    p.add_argument("--allowed-origins", type=_string_list, default=None, metavar="LIST",
                   help='CORS: origins whose pages may call the API, e.g. \'["https://app.example"]\' or \'["*"]\' '
                   "(vLLM's flag; default: no CORS headers, where vLLM allows every origin)")
    p.add_argument("--allowed-methods", type=_string_list, default=("*",), metavar="LIST", help='CORS methods (default ["*"])')
    p.add_argument("--allowed-headers", type=_string_list, default=("*",), metavar="LIST", help='CORS headers (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, Authorization)")
    from distserve.serving.limits import DEFAULT_HTTP_LIMITS as HTTP

    p.add_argument("--max-request-body-bytes", type=positive_int, default=HTTP.max_request_body_bytes, metavar="N",
                   help="a request body over N bytes is refused with 413 before it is read (default 8 MiB)")
    p.add_argument("--h11-max-incomplete-event-size", type=positive_int, default=HTTP.max_header_bytes, metavar="N",
                   help="bytes of a request's line and headers before 431 (vLLM's flag; default 64 KiB)")
    p.add_argument("--h11-max-header-count", type=positive_int, default=HTTP.max_header_count, metavar="N",
                   help="headers of a request before 431 (vLLM's flag; default 256)")
    p.add_argument("--timeout-keep-alive", type=positive_float, default=HTTP.timeout_keep_alive_s, metavar="S",
                   help="an idle connection (or one that sends nothing) is closed after S seconds (default 5, uvicorn's)")
    p.add_argument("--request-read-timeout", type=positive_float, default=HTTP.request_read_timeout_s, metavar="S",
                   help="a request's line and headers, and then its body, must each arrive within S seconds, else 408 and "
                   "the connection is closed (slow clients cannot hold connections; default 30)")
    p.add_argument("--ray-serve", action="store_true", help="run as a Ray Serve application (default: plain uvicorn)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_parser() -> argparse.ArgumentParser:
    from distserve.cli.commands import cmd_generate, cmd_plan, cmd_profile, cmd_simulate
    from distserve.cli.serve import cmd_serve

    parser = argparse.ArgumentParser(prog="distserve", description="distserve: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt with the colocated engine")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and timings")
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_args(srv)
    _add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)
    sim = sub.add_parser(
        "simulate",
        help="predict TTFT/TPOT/attainment (and goodput) of a placement with the simulator",
        description="Runs our real prefill/decode/colocated schedulers on a simulated clock, with step times from a "
        "latency model (a profile JSON, or the roofline model of --hardware).",
    )
    _add_simulate_args(sim)
    sim.set_defaults(func=cmd_simulate)
    pl = sub.add_parser(
        "plan",
        help="search the placement with the highest goodput per GPU and write it as a Placement JSON",
        description="Enumerates per-phase tensor/pipeline parallelism that fits, finds each configuration's goodput "
        "by simulation + bisection (DistServe's high/low node-affinity algorithms and the colocated baseline), and "
        "writes the best placement for `distserve serve --placement`.",
    )
    _add_plan_args(pl)
    pl.set_defaults(func=cmd_plan)
    prof = sub.add_parser(
        "profile",
        help="time the real engine's prefill/decode steps on this machine and fit a latency model",
        description="Times ModelRunner.execute on real scheduler plans over a grid of batch sizes and lengths, "
        "fits the simulator's latency model per tp degree and writes it as a profile JSON. "
        "Pipeline parallelism is not profiled: the simulator models pp from the tp profile.",
    )
    prof.add_argument("--model", default="smollm2-135m", help="tiny | smollm2-135m | HF folder | .gguf file")
    prof.add_argument("--tp", type=positive_int, action="append", default=None, metavar="N",
                      help="tensor-parallel degree to profile, repeatable (default 1); tp > 1 spawns N gloo processes")
    prof.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                      help="auto: bfloat16 on CPUs with AMX/AVX512-BF16, else float32 (what serving resolves)")
    prof.add_argument("--threads", type=positive_int, default=1,
                      help="torch threads per rank (default 1: the Ray runtime runs each worker with one thread)")
    prof.add_argument("--quick", action="store_true", help="a tiny grid (seconds for tiny, minutes for smollm2-135m)")
    prof.add_argument("--repeats", type=positive_int, default=3, help="timed steps per point (median), after a warm-up")
    prof.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    prof.add_argument("--quiet", action="store_true",
                      help="tp 1: time a step again (after waiting, at most --max-quiet-wait-s in all) when other "
                           "processes used the CPU meanwhile; the profile's meta counts them")
    prof.add_argument("--max-quiet-wait-s", type=float, default=600.0, metavar="S", help="with --quiet: longest total wait")
    prof.add_argument("--concurrency", action="store_true",
                      help="also measure how much a step slows down while another worker of this machine computes "
                           "(meta.concurrent_slowdown; the simulator's SimConfig.concurrent_slowdown)")
    prof.add_argument("--out", default="profile.json", metavar="FILE", help="where to write the profile JSON")
    prof.set_defaults(func=cmd_profile)
    return parser


def check_placement_args(args: argparse.Namespace) -> None:
    from distserve.errors import InvalidConfigError

    parallel = any(getattr(args, f) != 1 for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"))
    if args.placement is not None and (args.colocated is not None or args.prefill is not None or args.decode is not None or parallel):
        raise InvalidConfigError("--placement cannot be combined with --colocated/--prefill/--decode or TP/PP flags")
    if args.colocated is not None and (args.prefill is not None or args.decode is not None):
        raise InvalidConfigError("--colocated cannot be combined with --prefill/--decode")
    if args.colocated is not None and parallel:
        flags = [f"--{f.replace('_', '-')}" for f in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp") if getattr(args, f) != 1]
        raise InvalidConfigError(f"{'/'.join(flags)} set the parallelism of disaggregated instances, not of --colocated engines "
                                 "(a Placement JSON, --placement, gives colocated instances TP/PP)")


def placement_from_args(args: argparse.Namespace) -> "Placement":
    from distserve.placement import Placement

    if args.placement is not None:
        try:
            return Placement.load(args.placement)
        except DistServeError as exc:
            raise type(exc)(f"--placement {args.placement}: {exc}") from exc
    if args.colocated is not None:
        return Placement.colocated_instances(args.colocated)
    return Placement.disaggregated(
        args.prefill or 1, args.decode or 1, args.prefill_tp, args.prefill_pp, args.decode_tp, args.decode_pp
    )
