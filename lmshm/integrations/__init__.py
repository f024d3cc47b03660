"""Engine connectors: thin shims over one engine-neutral adapter (``adapter/``).

- ``lmshm.integrations.vllm``: ``LmshmConnector``, a vLLM v1 KV connector;
- ``lmshm.integrations.trtllm``: registration of a TensorRT-LLM KV pool and the same
  store/lookup/retrieve calls;
- ``lmshm.integrations.sglang``: ``LmshmHiCacheStorage``, an SGLang HiCache storage backend.
"""
