"""CORS, as vLLM's ``--allowed-origins``/``--allowed-methods``/``--allowed-headers``/``--allow-credentials`` set it,
through Starlette's ``CORSMiddleware``.

vLLM always adds the middleware and allows every origin (``["*"]``) by default. Here CORS is off unless
``--allowed-origins`` is given (no ``Access-Control-*`` headers: browsers keep other sites' pages from
reading the answers), because the server may hold API keys and tenants' sessions; give
``--allowed-origins '["*"]'`` for vLLM's default. Methods and headers default to ``["*"]``, as vLLM's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def parse_list(text: str) -> tuple[str, ...]:
    """A flag's list: vLLM's JSON (``'["http://a.example", "http://b.example"]'``) or comma-separated values."""
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)  # a ValueError here is argparse's "invalid value"
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a JSON list of strings")
        return tuple(value)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_cors(app: FastAPI, options: CorsOptions) -> None:
    """Answer CORS preflights and add ``Access-Control-*`` headers (outermost middleware: call last)."""
    app.add_middleware(
        CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=list(options.allowed_methods),
        allow_headers=list(options.allowed_headers), allow_credentials=options.allow_credentials,
    )
