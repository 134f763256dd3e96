"""Example LLM applications over ``distserve serve``, each written as a dataflow program and as request-centric client code.

``apps.programs`` holds the applications (chain and map-reduce summarisation, multi-agent coding, a
copilot with a shared system prompt, chat mixed with map-reduce jobs); ``apps.clients`` the two ways
of talking to the server (our dataflow frontend, and the OpenAI completions API awaited call by
call), both with a simulated client↔server delay. ``experiments/bench_apps.py`` times them.

A package beside the scripts rather than under ``distserve/``: these are example programs of the
API's users, not part of the server, and a script in ``experiments/`` imports it as ``apps`` (its
folder is on ``sys.path``) without any path edit; tests load it by file path.
"""

from apps.clients import DataflowClient, OutputOf, RequestClient, render, template_function
from apps.programs import App, AppResult, ChainSummary, Concurrent, Copilot, MultiAgentCoding, make_apps

__all__ = ["App", "AppResult", "ChainSummary", "Concurrent", "Copilot", "DataflowClient", "MultiAgentCoding", "OutputOf", "RequestClient", "make_apps",
           "render", "template_function"]
