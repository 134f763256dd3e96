"""The HTTP layer: the OpenAI-compatible API, its request/response protocol, Prometheus metrics and the Ray Serve app. No model code: it drives a ``distserve.runtime.client.EngineClient``."""
