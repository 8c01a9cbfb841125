"""kvsm: a KV-cache transfer connector for vLLM disaggregated serving, built on
explicit per-request state machines, one event loop per process and a
replayable event log."""

__version__ = "0.1.0"
