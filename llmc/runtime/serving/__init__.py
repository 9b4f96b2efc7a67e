"""HTTP serving over the engine: the OpenAI-compatible server, its request and response bodies, the async engine
thread and Prometheus metrics."""

DEFAULT_MAX_WAITING = 128  # requests queued beyond those running before new ones are refused
