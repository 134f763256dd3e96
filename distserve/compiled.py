"""The simulator's hot path compiled with mypyc: the same Python sources, about 3x faster.

A sweep runs thousands of simulations; each drives our real schedulers, block manager and
admission policies step by step, so the simulator's speed is that of plain Python objects and
calls. mypyc (the compiler mypy ships) turns the annotated modules below into C extensions with
the same behaviour: every simulation's records are identical (``tests/simulator/test_compiled.py``).

``build()`` (``make sim-fast``, also part of ``make install``) compiles ``MODULES`` into
``build/mypyc/`` beside the sources, never next to them, with a stamp: the digest of the sources
it compiled. ``activate()`` puts a finder first on ``sys.meta_path`` that loads those extensions
instead of the sources, only if the stamp matches the sources as they are now (an edited module
never runs stale compiled code: a stale build is reported once and everything runs interpreted).

Who runs compiled: ``import simulator`` activates, so a process that imports the simulator before
the modules it drives does — the ``simulate`` and ``plan`` commands (``distserve.cli``), the
sweeps and speed benchmarks under ``experiments/`` — and one that imports them first does not:
the server, the Ray instances and the test suite run them interpreted, as they did. It is all or
nothing per process (compiled classes subclass compiled classes), and ``DISTSERVE_COMPILED=0``
runs interpreted whatever is built. Compiled, a function checks its arguments' declared types
(``True`` is no ``float``), classes take no new attributes or weak references, and patching a
module's function or a class is not seen by compiled callers (tests that patch are marked
``interpreted``: ``tests/conftest.py``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent  # the source tree holding distserve/ and simulator/
BUILD_DIR = ROOT / "build" / "mypyc"
STAMP = "sources.sha256"
ENV = "DISTSERVE_COMPILED"  # "0": interpreted, whatever is built

# The simulator's event loop and what it drives every step; nothing here imports torch. Not the latency
# models (``simulator.latency``): the planner sends them to its worker processes, and a compiled class whose
# ``__init__`` takes arguments does not unpickle.
MODULES: tuple[str, ...] = (
    "simulator.simulation", "simulator.sim_instance", "simulator.sim_admission", "simulator.sim_migration",
    "simulator.sim_records", "simulator.sim_events", "simulator.lazy_decodes", "simulator.lazy_batch",
    "simulator.lazy_lanes", "simulator.fast_forward", "simulator.layer_preemption",
    "distserve.engine.scheduler", "distserve.engine.block_manager", "distserve.engine.sequence",
    "distserve.engine.instance_core", "distserve.engine.step_plan", "distserve.engine.step_outputs",
    "distserve.engine.preemptible", "distserve.engine.rank_order", "distserve.engine.prefix_grouping",
    "distserve.engine.step_intervals", "distserve.engine.forks",
    "distserve.cluster.admission", "distserve.cluster.fair_queue", "distserve.cluster.migration_queue",
    "distserve.cluster.backpressure", "distserve.cluster.routing", "distserve.cluster.classes",
    "distserve.cluster.tenants", "distserve.cluster.queue_rates",
    "distserve.prefill.scheduler", "distserve.decode.scheduler",
)
GROUP_SUFFIX = "__mypyc"  # the shared library mypyc puts every module's code in (``<hash>__mypyc``)

# mypyc compiles what mypy can type: imported modules are read for their types but not reported on,
# and the big third-party packages not read at all (their values are Any), which keeps a build at a minute.
MYPY_CONFIG = """[mypy]
follow_imports = silent
cache_dir = {cache_dir}

[mypy-torch.*,transformers.*,ray.*,scipy.*,numpy.*,matplotlib.*,fastapi.*,pydantic.*,pydantic_core.*,starlette.*,uvicorn.*,httpx.*,tokenizers.*,safetensors.*,gguf.*,llguidance.*,xgrammar.*,triton.*,regex.*,rich.*,prometheus_client.*,sentencepiece.*,huggingface_hub.*,aiohttp.*,jsonschema.*,openai.*]
follow_imports = skip
"""

def source_path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def sources_digest() -> str:
    """What a build is valid for: the compiled sources' bytes, and the interpreter's ABI."""
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag} {importlib.machinery.EXTENSION_SUFFIXES[0]}\n".encode())
    for module in MODULES:
        h.update(module.encode() + b"\0")
        h.update(source_path(module).read_bytes())
    return h.hexdigest()


def built_digest(build_dir: Path = BUILD_DIR) -> str | None:
    try:
        return (build_dir / STAMP).read_text().strip()
    except OSError:
        return None


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds ``MODULES`` (and mypyc's shared library) as the extensions in ``build_dir``."""

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = build_dir
        self.names = frozenset(MODULES)
        self.suffix = importlib.machinery.EXTENSION_SUFFIXES[0]

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names and not (fullname.endswith(GROUP_SUFFIX) and "." not in fullname):
            return None
        file = self.build_dir / (fullname.replace(".", "/") + self.suffix)
        if not file.is_file():
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


_state: dict[str, str] = {}  # "mode": "compiled" | "interpreted", "why": the reason when interpreted


def unusable(build_dir: Path = BUILD_DIR, env: Mapping[str, str] = os.environ) -> str:
    """Why ``build_dir``'s build may not be loaded into this process now; "" if it may."""
    if env.get(ENV, "") == "0":
        return f"{ENV}=0"
    stamp = built_digest(build_dir)
    if stamp is None:
        return "not built (make sim-fast)"
    if stamp != sources_digest():
        return "the compiled build is stale (run make sim-fast)"
    loaded = sorted(m for m in MODULES if m in sys.modules)
    if loaded:
        return f"imported before activation: {', '.join(loaded[:3])}"
    return ""


def activate(build_dir: Path = BUILD_DIR) -> bool:
    """Load ``MODULES`` compiled from now on if ``build_dir`` holds a build of the current sources
    and none of them is imported yet; the first call decides for the process."""
    if not _state:
        why = unusable(build_dir)
        if why.startswith("the compiled build is stale"):
            log.warning("distserve: %s; the simulator runs interpreted", why)
        if not why:
            sys.meta_path.insert(0, CompiledFinder(build_dir))
        _state.update(mode="interpreted" if why else "compiled", why=why)
    return _state["mode"] == "compiled"


def active() -> bool:
    """Whether this process loads ``MODULES`` compiled (``activate`` decided)."""
    return _state.get("mode") == "compiled"


def mode() -> str:
    """"compiled" or "interpreted": how this process runs ``MODULES`` (benchmarks report it)."""
    import simulator  # noqa: F401 - decides, if nothing imported it yet

    return _state["mode"]


def build(build_dir: Path = BUILD_DIR, quiet: bool = True) -> Path:
    """Compile ``MODULES`` into ``build_dir`` (replacing what is there) and stamp it; about a minute."""
    from mypyc.build import mypycify  # the build needs mypy (the `compiled` extra); running does not
    from setuptools import Distribution

    digest = sources_digest()
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="mypyc-", dir=build_dir.parent))  # renamed into place when done
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # mypyc names modules by their paths relative to here
        paths = [str(source_path(m).relative_to(ROOT)) for m in MODULES]
        config = staging / "mypy.ini"
        config.write_text(MYPY_CONFIG.format(cache_dir=build_dir.parent / "mypy-cache"))
        extensions = mypycify(["--config-file", str(config), *paths], opt_level="3", multi_file=True, target_dir=str(staging / "c"))
        dist = Distribution({"name": "distserve-compiled", "ext_modules": extensions})
        dist.script_args = ["build_ext", "--build-lib", str(staging / "lib"), "--build-temp", str(staging / "tmp"), "-j", str(os.cpu_count() or 1)]
        if quiet:
            dist.script_args.insert(0, "-q")
        dist.parse_command_line()
        dist.run_commands()
        if digest != sources_digest():
            raise RuntimeError("the sources changed while they were compiled; build again")
        (staging / "lib" / STAMP).write_text(digest + "\n")
        shutil.rmtree(build_dir, ignore_errors=True)
        (staging / "lib").rename(build_dir)
    finally:
        os.chdir(cwd)
        shutil.rmtree(staging, ignore_errors=True)
    return build_dir


def main() -> int:
    """``make sim-fast``: build unless the build is fresh."""
    if built_digest() == sources_digest():
        print(f"{BUILD_DIR} is up to date")
        return 0
    print(f"compiling {len(MODULES)} modules with mypyc into {BUILD_DIR} (about a minute)")
    build()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
