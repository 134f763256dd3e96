"""The processes that only route requests — the API server of the Ray runtime and its controller actor — never import
torch: it cost each of them ~180 MB of memory and ~1.5 s of CPU at every start. Their modules import it only where
tensors are made (an instance's workers, model weights)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distserve.engine.weights import load_model

pytestmark = pytest.mark.integration  # a fresh interpreter


def test_the_server_and_controller_modules_and_a_model_without_weights_do_not_import_torch() -> None:
    load_model("tiny")  # its cache index, which a process without weights reads
    code = (
        "import sys\n"
        "import distserve.cli, distserve.serving.api, distserve.runtime.remote_controller, distserve.runtime.controller_actor\n"
        "from distserve.engine.weights import load_model\n"
        "loaded = load_model('tiny', weights=False)\n"
        "loaded.tokenizer.encode('hello')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'safetensors.torch'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout[-2000:]
