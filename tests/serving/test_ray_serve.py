"""``serve run``: the example config (two ingress replicas over one 1P1D deployment of the tiny model)
and the config ``distserve plan --save-dir`` writes, both deployed for real.

Ray Serve runs in one ``serve run`` process (``serving_util.ServeRun``) with a private Ray: the test
suite's Ray session stays untouched. Startup is slow, so both configs' applications run in that one
``serve run``: the example's as committed, and the plan bundle's under the name ``plan`` and the route
``/plan`` (the only keys changed: a Serve cluster holds one application per route).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving_util import ServeRun, descendants, process_alive, wait_until

from distserve.config import SamplingParams
from distserve.engine.llm_engine import LLMEngine
from distserve.serving.app import REPLICA_HEADER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_config.yaml"
PROMPT = "Hello, my name is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def plan_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``distserve plan --save-dir`` for the tiny model (saved as a folder, which both the planner and the engine read)."""
    from distserve.cli import main
    from distserve.engine.tiny_model import build_tiny_hf_model

    root = tmp_path_factory.mktemp("plan")
    hf_model, tokenizer = build_tiny_hf_model()
    hf_model.save_pretrained(root / "tiny")
    tokenizer.hf.save_pretrained(root / "tiny")
    assert main(["plan", "--model", str(root / "tiny"), "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "2",
                 "--ttft", "250ms", "--tpot", "0.1s", "--num-requests", "40", "--json", "--save-dir", str(root / "bundle")]) == 0
    return root / "bundle"


@pytest.fixture(scope="module")
def serve_run(plan_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    """The example config as committed and the plan bundle's application (at ``/plan``), the proxy on a free port."""
    config = yaml.safe_load(EXAMPLE.read_text())
    (planned,) = yaml.safe_load((plan_bundle / "serve_config.yaml").read_text())["applications"]
    config["applications"].append({**planned, "name": "plan", "route_prefix": "/plan"})
    run = ServeRun(config, tmp_path_factory.mktemp("serve"))
    try:
        run.wait_ready()
        yield run
    finally:
        left = run.stop()
        assert not left, f"processes left behind by serve run: {left}"


@pytest.fixture(scope="module")
def expected_text() -> str:
    return LLMEngine("tiny").generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].text


def complete(url: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    with httpx.Client(timeout=60) as http:  # a new connection: the proxy picks a replica per request
        return http.post(f"{url}/v1/completions", json=body)


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of ``name`` in a /metrics text, by their labels (``model_name`` left out)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))] = s.value
    return out


def test_the_example_config_is_a_valid_app_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    from distserve.serving.app_config import ServeAppConfig

    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(EXAMPLE.read_text())).applications
    config = ServeAppConfig.from_args(app.args)
    assert config.num_replicas == 2 and config.replica_max_ongoing_requests > 5
    assert len(config.resolve().deployment.placement.prefill) == 1


def test_both_replicas_answer_as_the_engine_does(serve_run: ServeRun, expected_text: str) -> None:
    replicas: Counter[str] = Counter()
    for _ in range(40):  # the proxy picks a replica at random among the least loaded: both soon answer
        resp = complete(serve_run.url)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected_text
        replicas[resp.headers[REPLICA_HEADER]] += 1
        if len(replicas) == 2 and sum(replicas.values()) >= 4:
            break
    assert len(replicas) == 2, replicas
    with httpx.stream("POST", f"{serve_run.url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected_text


def test_metrics_of_either_replica_cover_every_replica_and_instance(serve_run: ServeRun) -> None:
    sent = 6
    for _ in range(sent):
        assert complete(serve_run.url, max_tokens=3).status_code == 200
    # A replica's /metrics adds the others' series as they last published them, which they do when
    # scraped: once both were scraped after the requests, either one's /metrics counts them all.
    scraped: set[str] = set()
    totals: dict[str, float] = {}
    engines: dict[str, set[str]] = {}
    for _ in range(60):
        resp = httpx.get(f"{serve_run.url}/metrics", timeout=30)
        assert resp.status_code == 200
        replica = resp.headers[REPLICA_HEADER]
        if len(scraped) == 2:
            totals[replica] = sum(series(resp.text, "distserve:request_success_total").values())
            engines[replica] = {dict(labels)["engine"] for labels in series(resp.text, "distserve:num_requests_running")}
        scraped.add(replica)
        if len(totals) == 2:
            break
    assert len(totals) == 2, f"only {scraped} answered /metrics"
    lengths = series(resp.text, "distserve:request_success_total")
    assert lengths[(("finished_reason", "length"),)] >= sent
    (first, second) = totals.values()
    assert first == second >= sent  # every request so far, whichever replica answered it
    assert all(names == {"prefill-0", "decode-0"} for names in engines.values()), engines


def test_a_replica_streams_more_than_five_requests_at_once(serve_run: ServeRun) -> None:
    """``max_ongoing_requests`` comes from the queue bound: 12 streams run at once on 2 replicas (Serve's default, 5, would hold 2 back)."""
    num_streams = 12
    started = threading.Barrier(num_streams + 1, timeout=120)
    done = threading.Event()
    replicas: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{serve_run.url}/v1/completions", json=body, timeout=120) as resp:
                replicas.append(resp.headers[REPLICA_HEADER])
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                started.wait()
                done.wait(120)  # leaves mid-stream: the request is aborted
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=stream) for _ in range(num_streams)]
    for t in threads:
        t.start()
    try:
        started.wait()  # every stream has its first token while none has ended
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert max(Counter(replicas).values()) > 5, Counter(replicas)


def test_the_plan_bundle_deploys_its_placement(serve_run: ServeRun, plan_bundle: Path) -> None:
    from distserve.placement import Placement

    placement = Placement.load(plan_bundle / "placement.json")
    (planned,) = yaml.safe_load((plan_bundle / "serve_config.yaml").read_text())["applications"]
    model = planned["args"]["model"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    resp = httpx.post(f"{serve_run.url}/plan/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    metrics = httpx.get(f"{serve_run.url}/plan/metrics", timeout=30).text
    engines = {dict(labels)["engine"] for labels in series(metrics, "distserve:num_requests_running")}
    kinds = [("prefill", placement.prefill), ("decode", placement.decode), ("colocated", placement.colocated)]
    assert engines == {f"{kind}-{i}" for kind, specs in kinds for i in range(len(specs))}


def test_deleting_the_apps_stops_their_deployments(serve_run: ServeRun) -> None:
    """(Last: it ends the deployments.) Deleting the apps through Serve stops the replicas; the last replica of each app
    tears its deployment down: no controller or instance process is left while Ray runs on."""
    engine = {pid for pid, cmd in descendants(serve_run.proc.pid).items() if "ray::ControllerActor" in cmd or "ray::InstanceServer" in cmd}
    assert len(engine) >= 2 + 4  # two controllers, four instances
    dashboard = re.search(r"http://127\.0\.0\.1:\d+", serve_run.log().split("View the dashboard at", 1)[1])
    assert dashboard is not None
    assert httpx.delete(f"{dashboard.group(0)}/api/serve/applications/", timeout=60).status_code == 200
    assert wait_until(lambda: not any(process_alive(pid) for pid in engine), 60), {p: c for p, c in descendants(serve_run.proc.pid).items() if p in engine}
    assert serve_run.proc.poll() is None  # Ray and Serve still run
