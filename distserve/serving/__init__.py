"""Serving: controller, routing, migration orchestration, HTTP API, metrics."""
