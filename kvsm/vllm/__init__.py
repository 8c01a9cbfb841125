"""The vLLM adapter: the only kvsm package that imports vLLM. The connector
class vLLM loads, its plugin registration, the step metadata on vLLM's base
class, vLLM's stats and Prometheus classes, reading vLLM's config, and the
vLLM-CPU token layout of a block."""
