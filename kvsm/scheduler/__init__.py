"""The scheduler half: vLLM's scheduler hooks turned into facts for the
workers, ``kv_transfer_params`` and block pairing. No vLLM import: the vLLM
adapter (``kvsm.vllm``) wraps what it returns in vLLM's types."""
