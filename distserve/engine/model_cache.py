"""Where distserve caches what it builds or converts: SmolLM2 and GGUF models converted to safetensors, the tiny
test model's weights (``cache_dir``); and its one-line messages about them on stderr (``log``)."""

from __future__ import annotations

import os
import pathlib
import sys


def cache_dir() -> pathlib.Path:
    """``$DISTSERVE_CACHE``, else ``$XDG_CACHE_HOME/distserve``, else ``~/.cache/distserve``."""
    if os.environ.get("DISTSERVE_CACHE"):
        return pathlib.Path(os.environ["DISTSERVE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "distserve"
    return pathlib.Path.home() / ".cache" / "distserve"


def log(message: str) -> None:
    print(f"[distserve] {message}", file=sys.stderr, flush=True)
