"""The Ray Serve app's configuration: ``ServeAppConfig``, the typed ``args`` of ``serve run``, and
``ServeApp``, what it resolves to before any replica starts.

Each field of ``ServeAppConfig`` is the ``distserve serve`` flag of the same name (``kv_cache_gb`` is
``--kv-cache-gb``) and means the same, because it is turned into the ``DeploymentConfig`` by the same
code (``cli.serve.deployment_config_of``); ``placement`` also takes a Placement inline (a mapping, or
its JSON text), and the Serve fields (``num_replicas``, ``max_ongoing_requests``) say how many ingress
replicas answer HTTP. Values may be strings (``serve run ... key=value``). A bad value is an
``InvalidConfigError`` naming its field.

Everything a file holds (the placement, the API keys, a chat template) is read in ``resolve``, where the app is built,
so that the replicas, wherever Ray puts them, receive data rather than paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, ValidationInfo, field_validator

from distserve.cluster.admission import DEFAULT_MAX_WAITING, DEFAULT_WAITING_UNIT, WAITING_UNITS
from distserve.cluster.fair_queue import ADMISSION_POLICIES, DEFAULT_ADMISSION_POLICY
from distserve.cluster.routing import DEFAULT_ROUTER, ROUTERS
from distserve.dataflow.limits import DEFAULT_LIMITS, SessionLimits
from distserve.engine.grammar_backends import STRUCTURED_OUTPUT_BACKENDS
from distserve.errors import DistServeError, InvalidConfigError
from distserve.placement import Placement
from distserve.runtime.config import SERVER_MAX_QUEUED_REQUESTS, DeploymentConfig
from distserve.serving.api_keys import ApiKeys
from distserve.serving.cors import CorsOptions, parse_list
from distserve.serving.metrics_exposition import METRICS_PREFIXES, OWN_PREFIX
from distserve.slo import SLO, parse_latency

# Requests a replica takes beyond the queue bound: when the engine's queue is full the next
# requests still reach a replica, to be refused at once (429), and /metrics, /health still answer.
MAX_ONGOING_HEADROOM = 16
SERVE_FIELDS = ("num_replicas", "max_ongoing_requests", "replica_cpus")  # not `distserve serve` flags
REPLICA_CPUS = 0.1  # Ray bookkeeping: Serve's default of 1 CPU per replica does not fit small machines


# Fields whose value is one of a registry's names.
_CHOICES: dict[str, Any] = {
    "router": ROUTERS, "admission_policy": ADMISSION_POLICIES, "waiting_unit": WAITING_UNITS, "metrics_prefix": METRICS_PREFIXES,
    "structured_output_backend": STRUCTURED_OUTPUT_BACKENDS,
}


class ServeAppConfig(BaseModel):
    """The Ray Serve app's ``args``: the ``distserve serve`` flags of the same names, plus the Serve fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_cache_gb: PositiveFloat = 0.5
    block_size: PositiveInt = 16
    decode_attention: str | None = None  # checked by ``CacheConfig``
    # The placement: a Placement JSON file, or the Placement itself (a mapping, or JSON text)...
    placement: str | dict[str, Any] | None = None
    # ... or the shorthand flags.
    colocated: PositiveInt | None = None
    prefill: PositiveInt | None = None
    decode: PositiveInt | None = None
    prefill_tp: PositiveInt = 1
    prefill_pp: PositiveInt = 1
    decode_tp: PositiveInt = 1
    decode_pp: PositiveInt = 1
    router: str = DEFAULT_ROUTER
    threads: PositiveInt | None = None
    kv_transfer_timeout: PositiveFloat | None = None
    ttft_slo: float | None = None  # seconds, or a latency such as "200ms"
    tpot_slo: float | None = None
    max_queued_requests: PositiveInt = SERVER_MAX_QUEUED_REQUESTS
    admission_policy: str = DEFAULT_ADMISSION_POLICY
    waiting_unit: str = DEFAULT_WAITING_UNIT
    max_waiting: PositiveInt = DEFAULT_MAX_WAITING
    no_backpressure: bool = False
    tpot_backpressure: bool = False
    max_queue_delay: float | None = None  # seconds, or a latency such as "2s"
    prefill_chunk: PositiveInt | None = None
    no_layer_preemption: bool = False
    session_ttl: PositiveFloat = DEFAULT_LIMITS.ttl_s
    max_sessions: PositiveInt = DEFAULT_LIMITS.max_sessions
    max_variables: PositiveInt = DEFAULT_LIMITS.max_variables
    max_pending_calls: PositiveInt = DEFAULT_LIMITS.max_pending_calls
    max_value_chars: PositiveInt = DEFAULT_LIMITS.max_value_chars
    parrot_unauthenticated_calls: bool = False
    api_keys: str | None = None  # the key file
    metrics_prefix: str = OWN_PREFIX
    tool_call_parser: Literal["hermes"] | None = None
    enable_auto_tool_choice: bool = False
    structured_output_backend: str | None = None
    chat_template: str | None = None  # a file, or the template itself
    max_model_len: PositiveInt | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    allowed_origins: tuple[str, ...] | None = None  # CORS: a list, JSON text or comma-separated values
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Ray Serve: the ingress replicas, which all share one controller (one deployment of the placement).
    num_replicas: PositiveInt = 1
    max_ongoing_requests: PositiveInt | None = Field(
        default=None, description=f"requests one replica takes at once; default max_queued_requests + {MAX_ONGOING_HEADROOM}")
    replica_cpus: float = Field(default=REPLICA_CPUS, gt=0)

    @field_validator("ttft_slo", "tpot_slo", "max_queue_delay", mode="before")
    @classmethod
    def _latency(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            try:
                return parse_latency(value, info.field_name)
            except InvalidConfigError as exc:
                raise ValueError(str(exc).removeprefix(f"{info.field_name} ")) from None
        return value

    @field_validator("ttft_slo", "tpot_slo", "max_queue_delay")
    @classmethod
    def _positive_latency(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(f"must be a latency > 0, got {value}")
        return value

    @field_validator(*_CHOICES)
    @classmethod
    def _one_of(cls, value: str | None, info: ValidationInfo) -> str | None:
        choices = _CHOICES[info.field_name or ""]
        if value is not None and value not in choices:
            raise ValueError(f"must be one of {', '.join(sorted(choices))}")
        return value

    @field_validator("placement", mode="before")
    @classmethod
    def _placement_json(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"inline Placement JSON is not valid JSON: {exc}") from None
        return value

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _string_list(cls, value: Any) -> Any:
        return parse_list(value) if isinstance(value, str) else value

    @field_validator("enable_auto_tool_choice")
    @classmethod
    def _tool_choice(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("tool_call_parser") is None:
            raise ValueError("needs tool_call_parser (e.g. hermes)")
        return value

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ServeAppConfig:
        """The config of ``args`` (``serve run`` passes strings); an ``InvalidConfigError`` naming the first bad field."""
        try:
            return cls.model_validate(dict(args))
        except ValidationError as exc:
            raise _config_error(exc) from None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServeAppConfig:
        """The config of ``distserve serve --ray-serve``'s flags (those that have a field here)."""
        given = {name: getattr(args, name) for name in cls.model_fields if name not in SERVE_FIELDS and hasattr(args, name)}
        return cls.from_args(given)

    @property
    def replica_max_ongoing_requests(self) -> int:
        """``max_ongoing_requests``, by default the engine's queue bound plus ``MAX_ONGOING_HEADROOM``: every
        replica can hold as many streams as the shared queue admits (Serve's default, 5, would cap each at 5)."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return self.max_queued_requests + MAX_ONGOING_HEADROOM

    def cli_args(self) -> argparse.Namespace:
        """The ``distserve serve`` flags this config stands for (every other flag at its default)."""
        from distserve.cli.args import build_parser

        args = build_parser().parse_args(["serve"])
        for name, value in self.model_dump(exclude=set(SERVE_FIELDS)).items():
            setattr(args, name, value)
        return args

    def resolve_placement(self, args: argparse.Namespace) -> Placement:
        """The placement: ``placement`` (a file, or inline) or the shorthand fields; the batch caps and ``threads`` applied."""
        from distserve.cli.args import check_placement_args, placement_from_args

        try:
            check_placement_args(args)
            if isinstance(self.placement, dict):
                placement = Placement.from_dict(self.placement)
            elif self.placement is not None:
                placement = Placement.load(self.placement)
            else:
                placement = placement_from_args(args)
            placement = placement.with_caps(max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                                            max_num_batched_tokens=self.max_num_batched_tokens)
        except DistServeError as exc:
            raise InvalidConfigError(f"app config placement: {_field_names(str(exc))}", "placement") from None
        return placement if self.threads is None else placement.with_threads(self.threads)

    def resolve(self) -> ServeApp:
        """Everything the replicas need, with the placement and key files read (errors name the field)."""
        from distserve.cli.serve import api_keys_of, chat_template_of, cors_of, deployment_config_of, serve_slo, session_limits

        args = self.cli_args()
        placement = self.resolve_placement(args)
        if self.allowed_origins is None and (self.allowed_methods, self.allowed_headers, self.allow_credentials) != (("*",), ("*",), False):
            raise InvalidConfigError("app config allowed_origins: allowed_methods/allowed_headers/allow_credentials need it "
                                     "(without it the server sends no CORS headers)", "allowed_origins")
        try:
            api_keys = api_keys_of(args)
            chat_template = chat_template_of(args)
            slo = serve_slo(args, placement)
            deployment = deployment_config_of(args, placement, slo, api_keys)
            limits = session_limits(args)
        except DistServeError as exc:
            raise InvalidConfigError(f"app config: {_field_names(str(exc))}", exc.param) from None
        return ServeApp(
            deployment=deployment, served_model_name=self.served_model_name or self.model, slo=slo, session_limits=limits,
            api_keys=api_keys, metrics_prefix=self.metrics_prefix, tool_call_parser=self.tool_call_parser,
            enable_auto_tool_choice=self.enable_auto_tool_choice, chat_template=chat_template, cors=cors_of(args),
            num_replicas=self.num_replicas,
            max_ongoing_requests=self.replica_max_ongoing_requests, replica_cpus=self.replica_cpus,
        )


def _config_error(exc: ValidationError) -> InvalidConfigError:
    """The first error of ``exc`` as ``app config <field>: <what is wrong> (got <value>)``."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        known = ", ".join(name for name in ServeAppConfig.model_fields)
        return InvalidConfigError(f"app config: unknown field {field!r}; the fields are {known}", field)
    message = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    given = "" if isinstance(value, dict) or repr(value) in message else f" (got {value!r:.80})"
    return InvalidConfigError(f"app config {field}: {message}{given}", field)


def _field_names(message: str) -> str:
    """A message of the ``distserve serve`` code with its flags named as this config's fields (``--kv-cache-gb``: ``kv_cache_gb``)."""
    return re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), message)


@dataclass(frozen=True)
class ServeApp:
    """The resolved app: what every ingress replica serves, and how many replicas Serve runs."""

    deployment: DeploymentConfig
    served_model_name: str
    slo: SLO | None
    session_limits: SessionLimits
    api_keys: ApiKeys | None
    metrics_prefix: str
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    chat_template: str | None
    cors: CorsOptions | None
    num_replicas: int
    max_ongoing_requests: int
    replica_cpus: float

    def controller_name(self, app_name: str) -> str:
        """The name of the controller the app's replicas share: the app's, and this deployment's digest
        (a redeployed app with another config gets a controller of its own while the old one drains)."""
        digest = hashlib.sha256(repr(self.deployment).encode()).hexdigest()[:12]
        return f"{app_name}-{digest}"
