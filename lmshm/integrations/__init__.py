"""Adapters for inference engines (vLLM, TRT-LLM). They own no logic of their own."""
