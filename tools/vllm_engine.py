"""A tiny real vLLM engine with LmshmConnector, for ``scripts/demo-vllm``, the real-engine tests
and the vLLM benchmarks. Not part of lmshm: a tool the scripts and tests run, inside .venv-vllm
(``scripts/bootstrap-vllm``), as a script (its folder holds nothing that shadows a package)::

    python tools/vllm_engine.py build DIR [--hybrid]
    python tools/vllm_engine.py serve-stdin DIR URL [--pump-s S] [the options of serve]
    python tools/vllm_engine.py serve DIR URL OUT.json --batch PROMPTS.json [--batch ...]
        [--sync DIR] [--salt S] [--corrupt] [--fail-loads] [--fail-loads-rank R] [--no-connector]
        [--block-size N] [--chunk-tokens N] [--tp N] [--metrics] [--extra KEY=JSON ...]
        [--kv-events ENDPOINT [--kv-events-topic TOPIC]]

``build`` saves a random ``LlamaForCausalLM`` (2 layers, hidden 128, head size 64, float32,
weights drawn with a wide spread so greedy decoding has clear winners) to DIR: no download.
``--hybrid`` builds a Gemma-3-style model instead: three sliding-window layers (window 128) and
one full-attention layer, which vLLM serves with its hybrid KV cache manager.

A prompt in a batch file is a list of token ids, or ``{"tokens": [...], "cache_salt": "...",
"kv_transfer_params": {...}, "prompt_logprobs": N}``. ``--metrics`` adds vLLM's own metrics
(``llm.get_metrics()``, the ``vllm:lmshm_*`` and ``vllm:external_prefix_cache_*`` series) to OUT
and makes vLLM log its stats (the "KV Transfer metrics" line) before it exits. ``--kv-events``
turns on vLLM's KV-event stream (``--kv-events-config``: ZMQ PUB at ENDPOINT), which carries what
lmshm's connector yields. ``--tp 2`` runs
tensor parallel with vLLM's multiprocess executor.

``serve-stdin`` is the long-running form, for a router that sends requests one at a time, to
each engine as it chooses (``bench/kv_routing.py``); it takes serve's options but ``--batch``
and ``--sync``. It writes ``{"ready": true}`` once the engine is up, then reads one JSON line
per request from stdin, ``{"tokens": [...], "cache_salt": "...", "max_tokens": N}`` (the last
two optional), and answers each with one line, ``{"output": [...], "cached": N, "prompt": N,
"seconds": S}`` (``seconds`` around the ``generate``: with ``max_tokens`` 1, the time to first
token). After each request it keeps the engine stepping (tiny 3-token requests that store
nothing) for up to ``--pump-s`` seconds, so that the connector's KV events reach the stream
while no request runs; the next line ends that early. A line without ``"tokens"`` is answered
``{"idle": true}`` (a caller's way to stop the pump). It exits at the end of stdin. Everything
else the process prints (vLLM's logs) goes to stderr.

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
import queue
import sys
import threading
import time


def build(path: str, hybrid: bool = False) -> None:
    import torch

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    if hybrid:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=128,
                                  max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="float32")
        model = Gemma3ForCausalLM(config)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
                             torch_dtype="float32")
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            # a wide spread: greedy decoding has clear winners (Gemma's 1-D norm weights too,
            # or decoding repeats one token)
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.2)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)


def _make_llm(args: argparse.Namespace):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {"lmshm.url": args.url, "lmshm.chunk_tokens": args.chunk_tokens, "lmshm.salt": args.salt,
             "lmshm.retry_s": 2.0}
    if args.corrupt:
        extra["lmshm.test_corrupt_loads"] = True
    if args.fail_loads:
        extra["lmshm.test_fail_loads"] = True
    if args.fail_loads_rank >= 0:
        extra["lmshm.test_fail_loads_rank"] = args.fail_loads_rank
    for item in args.extra:
        key, _, value = item.partition("=")
        extra[key] = json.loads(value)
    if args.no_connector:
        ktc = None
    else:
        ktc = KVTransferConfig(kv_connector="LmshmConnector", kv_connector_module_path="lmshm.integrations.vllm",
                               kv_role="kv_both", kv_connector_extra_config=extra)
    parallel = {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"} if args.tp > 1 else {}
    if args.kv_events:
        from vllm.config import KVEventsConfig

        parallel["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                      endpoint=args.kv_events, topic=args.kv_events_topic)
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=args.block_size, max_model_len=8192, max_num_batched_tokens=8192,
              enable_prefix_caching=False, seed=0, kv_transfer_config=ktc, disable_log_stats=not args.metrics,
              **parallel)
    return llm


def _params(args: argparse.Namespace, prompt: dict):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=prompt["tokens"])
    if prompt.get("cache_salt"):
        request["cache_salt"] = prompt["cache_salt"]
    params = SamplingParams(temperature=0.0, max_tokens=prompt.get("max_tokens", args.max_tokens), ignore_eos=True,
                            prompt_logprobs=prompt.get("prompt_logprobs"),
                            extra_args={"kv_transfer_params": prompt["kv_transfer_params"]}
                            if "kv_transfer_params" in prompt else None)
    return request, params


def _one(llm, args: argparse.Namespace, prompt: dict) -> dict:
    request, params = _params(args, prompt)
    t0 = time.perf_counter()
    result = llm.generate([request], params, use_tqdm=False)[0]
    return {"output": list(result.outputs[0].token_ids), "cached": result.num_cached_tokens or 0,
            "prompt": len(prompt["tokens"]), "seconds": time.perf_counter() - t0}


def _tiny_step(llm) -> None:
    """One short request (3 tokens, less than a block: nothing to store or load) so the engine
    takes a step, and the connector hands its KV events to vLLM's stream."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)


def serve(args: argparse.Namespace) -> None:
    llm = _make_llm(args)
    out: dict = {"hybrid_kv_cache_manager": _hybrid_manager_on(llm)}
    batches = []
    for i, batch_file in enumerate(args.batch):
        if i and args.sync:
            open(os.path.join(args.sync, f"ready-{i}"), "w").close()
            while not os.path.exists(os.path.join(args.sync, f"go-{i}")):
                time.sleep(0.05)
        with open(batch_file) as f:
            prompts = json.load(f)
        results = []
        for prompt in prompts:  # one at a time: each request sees what the ones before it stored
            prompt = prompt if isinstance(prompt, dict) else {"tokens": prompt}
            prompt.pop("max_tokens", None)   # serve: --max-tokens for every prompt
            results.append(_one(llm, args, prompt))
        batches.append(results)
    if args.kv_events:   # a few idle steps: the connector's last KV_EVENTS replies reach the stream
        for _ in range(args.event_steps):
            _tiny_step(llm)
            time.sleep(0.05)
    out["batches"] = batches
    if args.metrics:
        llm.llm_engine.do_log_stats()   # the "KV Transfer metrics" line, in this process's log
        out["metrics"] = _metrics(llm)
    with open(args.out, "w") as f:
        json.dump(out, f)
    del llm


def serve_stdin(args: argparse.Namespace) -> None:
    """See the module docstring: one JSON line in, one out, until the end of stdin."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                  # vLLM's logs (and anything else printed) go to stderr
    sys.stdout = sys.stderr
    llm = _make_llm(args)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="stdin", daemon=True).start()

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    answer({"ready": True})
    pump_until = 0.0
    while True:
        try:
            line = lines.get(timeout=0.02 if time.monotonic() < pump_until else None)
        except queue.Empty:
            _tiny_step(llm)
            continue
        if line is None:
            break
        if not line.strip():
            continue
        prompt = json.loads(line)
        if "tokens" not in prompt:
            pump_until = 0.0
            answer({"idle": True})
            continue
        answer(_one(llm, args, prompt))
        pump_until = time.monotonic() + args.pump_s
    answers.close()
    del llm


def _hybrid_manager_on(llm) -> bool:
    config = llm.llm_engine.vllm_config
    return not config.scheduler_config.disable_hybrid_kv_cache_manager


def _metrics(llm) -> dict:
    """vLLM's own metrics about external KV: counters by name (summed over labels), and for a
    histogram its count."""
    out: dict = {}
    for metric in llm.get_metrics():
        if "lmshm" not in metric.name and "external_prefix_cache" not in metric.name:
            continue
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "count", None)
        out[metric.name] = out.get(metric.name, 0) + (value or 0)
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "build":
        build(argv[1], hybrid="--hybrid" in argv[2:])
        return 0
    stdin = bool(argv) and argv[0] == "serve-stdin"
    ap = argparse.ArgumentParser(prog="python tools/vllm_engine.py")
    ap.add_argument("cmd", choices=["serve-stdin" if stdin else "serve"])
    ap.add_argument("model")
    ap.add_argument("url")
    if stdin:
        ap.add_argument("--pump-s", type=float, default=1.0,
                        help="after each request, keep stepping for up to this long so its KV events are sent")
    else:
        ap.add_argument("out")
        ap.add_argument("--batch", action="append", required=True)
        ap.add_argument("--sync", default="")
    ap.add_argument("--salt", default="")
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--fail-loads", action="store_true")
    ap.add_argument("--fail-loads-rank", type=int, default=-1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--metrics", action="store_true")
    ap.add_argument("--extra", action="append", default=[], help="another kv_connector_extra_config KEY=JSON")
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-events", default="", help="vLLM's KV-event PUB endpoint (enables --kv-events-config)")
    ap.add_argument("--kv-events-topic", default="")
    ap.add_argument("--event-steps", type=int, default=10, help="short requests run at the end to flush events")
    args = ap.parse_args(argv)
    if stdin:
        serve_stdin(args)
    else:
        serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
