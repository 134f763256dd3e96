"""Tools that measure rather than serve: the engine profiler (feeds the latency model), the OpenAI load generator and the serving benchmark."""
