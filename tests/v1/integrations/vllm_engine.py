"""Runs inside .venv-vllm: build the tiny random Llama, or serve prompts with a real vLLM engine.

    python vllm_engine.py build DIR
    python vllm_engine.py serve DIR URL PROMPTS.json OUT.json [--corrupt] [--block-size N] [--chunk-tokens N]

``serve`` runs one ``LLM`` with ``LmshmConnector``, greedy, and writes per prompt its output
token ids and ``num_cached_tokens`` (tokens the connector supplied; prefix caching is off).
Which process mode runs is the caller's ``VLLM_ENABLE_V1_MULTIPROCESSING``.
"""

from __future__ import annotations

import json
import os
import sys


def build(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)


def serve(path: str, url: str, prompts_file: str, out_file: str, *, corrupt: bool, block_size: int,
          chunk_tokens: int, max_tokens: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    with open(prompts_file) as f:
        prompts = json.load(f)
    extra = {"lmshm.url": url, "lmshm.chunk_tokens": chunk_tokens}
    if corrupt:
        extra["lmshm.test_corrupt_loads"] = True
    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=block_size,
              max_model_len=8192, max_num_batched_tokens=8192, enable_prefix_caching=False, seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="LmshmConnector",
                                                  kv_connector_module_path="lmshm.integrations.vllm",
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = []
    for tokens in prompts:  # one at a time: each request sees what the ones before it stored
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        results.append({"output": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                        "prompt": len(tokens)})
    with open(out_file, "w") as f:
        json.dump(results, f)
    del llm


def main(argv: list[str]) -> int:
    if argv[0] == "build":
        build(argv[1])
        return 0
    args = argv[1:]
    flags = {a for a in args if a.startswith("--")}

    def opt(name: str, default: int) -> int:
        return int(args[args.index(name) + 1]) if name in args else default

    positional = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or not args[i - 1].startswith("--")
                                                                             or args[i - 1] == "--corrupt")]
    path, url, prompts_file, out_file = positional[:4]
    serve(path, url, prompts_file, out_file, corrupt="--corrupt" in flags, block_size=opt("--block-size", 32),
          chunk_tokens=opt("--chunk-tokens", 32), max_tokens=opt("--max-tokens", 8))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
