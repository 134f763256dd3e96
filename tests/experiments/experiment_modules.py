"""Load ``experiments/`` modules in tests: by path, under their own names (the scripts import each other's shared
modules that way, e.g. ``import harness``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_experiment(name: str) -> ModuleType:
    """``experiments/{name}.py`` as module ``name`` (loaded once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
