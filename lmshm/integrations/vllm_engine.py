"""A tiny real vLLM engine with LmshmConnector, for ``scripts/demo-vllm``, the real-engine tests
and ``bench/vllm_ttft.py``. Runs inside .venv-vllm (``scripts/bootstrap-vllm``)::

    python -m lmshm.integrations.vllm_engine build DIR
    python -m lmshm.integrations.vllm_engine serve DIR URL OUT.json --batch PROMPTS.json [--batch ...]
        [--sync DIR] [--salt S] [--corrupt] [--fail-loads] [--no-connector] [--block-size N] [--chunk-tokens N]

``build`` saves a random ``LlamaForCausalLM`` (2 layers, hidden 128, head size 64, float32,
weights drawn with a wide spread so greedy decoding has clear winners) to DIR: no download.

``serve`` starts one ``LLM`` with ``LmshmConnector`` (greedy, vLLM's own prefix caching off, so
every cached token came from lmshm) and serves each batch's prompts one at a time. Before batch
``i > 0`` it writes ``SYNC/ready-i`` and waits for ``SYNC/go-i``, so a test can restart or stop
the server between batches with the same engine running. OUT gets, per batch and prompt, the
output token ids, ``num_cached_tokens`` and the seconds it took. Which process mode runs is the
caller's ``VLLM_ENABLE_V1_MULTIPROCESSING``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


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
            p.normal_(0.0, 0.2)  # a wide spread: greedy decoding has clear winners
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)


def serve(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {"lmshm.url": args.url, "lmshm.chunk_tokens": args.chunk_tokens, "lmshm.salt": args.salt,
             "lmshm.retry_s": 2.0}
    if args.corrupt:
        extra["lmshm.test_corrupt_loads"] = True
    if args.fail_loads:
        extra["lmshm.test_fail_loads"] = True
    if args.no_connector:
        ktc = None
    else:
        ktc = KVTransferConfig(kv_connector="LmshmConnector", kv_connector_module_path="lmshm.integrations.vllm",
                               kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=args.block_size, max_model_len=8192, max_num_batched_tokens=8192,
              enable_prefix_caching=False, seed=0, kv_transfer_config=ktc)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = []
    for i, batch_file in enumerate(args.batch):
        if i and args.sync:
            open(os.path.join(args.sync, f"ready-{i}"), "w").close()
            while not os.path.exists(os.path.join(args.sync, f"go-{i}")):
                time.sleep(0.05)
        with open(batch_file) as f:
            prompts = json.load(f)
        results = []
        for tokens in prompts:  # one at a time: each request sees what the ones before it stored
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
            results.append({"output": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                            "prompt": len(tokens), "seconds": time.perf_counter() - t0})
        batches.append(results)
    with open(args.out, "w") as f:
        json.dump(batches, f)
    del llm


def main(argv: list[str]) -> int:
    if argv and argv[0] == "build":
        build(argv[1])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--batch", action="append", required=True)
    ap.add_argument("--sync", default="")
    ap.add_argument("--salt", default="")
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--fail-loads", action="store_true")
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    serve(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
