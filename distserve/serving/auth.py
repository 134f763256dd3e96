"""Who a request is for: the API-key check in front of every route, and the tenant it leaves on the request.

With keys configured (``serve --api-keys FILE``, ``distserve.serving.api_keys``), every request
must carry ``Authorization: Bearer <key>``; a missing or wrong key is a 401 in OpenAI's shape
(``code: invalid_api_key``, with ``WWW-Authenticate: Bearer``) before any route runs — the OpenAI
routes, the semantic-variable routes, ``/v1/models``, the API docs and unknown paths alike. Only
``OPEN_PATHS`` stay open: ``/health`` and ``/ping`` (vLLM's alias of it), because liveness probes
(Kubernetes, load balancers, SageMaker) carry no credentials and they say only up or down; ``/metrics``, because Prometheus scrapes it as
infrastructure and it holds counts and latencies labelled by tenant name, never a key, prompt or
id — and any key would be the wrong gate for it anyway, since every tenant would then read every
other tenant's series. Keep ``/metrics`` on a network only the scraper reaches.

The request's tenant (``TenantSpec``) is put in the ASGI scope, where ``tenant_of`` reads it;
without keys every request is the ``ANONYMOUS`` tenant, today's behaviour.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from distserve.cluster.tenants import ANONYMOUS_TENANT, TenantSpec
from distserve.serving.api_keys import ApiKeys
from distserve.serving.http_errors import error_response
from distserve.serving.metrics import ServingMetrics
from distserve.serving.protocol import APIError

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
TENANT_SCOPE_KEY = "distserve.tenant"
_MISSING = "Missing API key: send it in an `Authorization: Bearer <key>` header."
_WRONG = "Incorrect API key provided."  # never echoes the key, not even a prefix


def tenant_of(request: Request) -> TenantSpec:
    """The tenant the request was authenticated as (``ANONYMOUS_TENANT`` without keys)."""
    return request.scope.get(TENANT_SCOPE_KEY, ANONYMOUS_TENANT)  # type: ignore[no-any-return]


def owner_of(request: Request) -> str:
    """Who a request's share of a bounded shared resource (grammar compiles) is counted against: its tenant
    with API keys; without them, the anonymous tenant's client address, the only identity there is."""
    if TENANT_SCOPE_KEY in request.scope:
        return tenant_of(request).name
    client = request.client
    return f"{ANONYMOUS_TENANT.name}@{client.host if client is not None else '?'}"


def bearer_key(scope: Scope) -> str | None:
    """The key of the request's ``Authorization: Bearer`` header (None: no such header)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            return key.strip() if scheme.lower() == "bearer" and key.strip() else None
    return None


def unauthorized(missing: bool) -> APIError:
    return APIError(401, _MISSING if missing else _WRONG, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="distserve"'})


class ApiKeyAuth:
    """ASGI middleware: authenticate each HTTP request by its bearer key (see the module docstring)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics: ServingMetrics | None = None) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            key = bearer_key(scope)
            tenant = self.keys.authenticate(key) if key is not None else None
            if tenant is None:
                if self.metrics is not None:
                    self.metrics.requests_unauthenticated.inc()
                await error_response(unauthorized(missing=key is None))(scope, receive, send)
                return
            scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


__all__ = ["ApiKeyAuth", "OPEN_PATHS", "TENANT_SCOPE_KEY", "bearer_key", "owner_of", "tenant_of", "unauthorized"]
