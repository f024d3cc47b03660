"""lmshm's chunk keys keep apart what vLLM's own block hashes keep apart, and agree across processes.

The connector keys chunks by vLLM's ``request.block_hashes`` (``chunk_keys_from_hashes``), so the
request's identity (cache salt, LoRA adapter, images, prompt embeddings) reaches lmshm only if vLLM
folds it into those hashes (``generate_block_hash_extra_keys`` in vllm/v1/core/kv_cache_utils.py).
These tests drive vLLM 0.32's own machinery, not a copy of it: a script run by ``.venv-vllm``'s
Python builds real ``vllm.v1.request.Request`` objects with the block hasher the engine core
builds (``init_none_hash`` + ``get_request_block_hasher(block_size, get_hash_fn_by_name(algo))``)
and prints lmshm's keys for 128 prompt tokens (four 32-token blocks, one block per chunk).

Multimodal features are built without a processor: vLLM hashes only a feature's ``identifier``
and ``mm_position`` (``_gen_mm_extra_hash_keys``), and ``MultiModalFeatureSpec.data`` may be
None (vLLM sends it so when the item is cached), so the images here are placeholders with
identifiers, not pixels; how a real processor derives the identifier is not tested here.

The one thing easy to get wrong: the block hashes chain, so a key that an extra input changes
stays changed for every later chunk, while the chunks before the first affected block stay
shared (the prefix sharing an image prompt should get).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from vllm_harness import VLLM_PYTHON, _env

pytestmark = pytest.mark.vllm

BLOCK = 32
TOKENS = 128
IMAGE = (40, 32)     # an image placeholder over tokens 40..71: blocks 1 and 2
EMBEDS_EDIT = 70     # the prompt-embeds variant changes rows from here on: block 2 on

# Run by .venv-vllm's Python as ``python -c SCRIPT ALGO OUT``, from a scratch directory (so no
# file named vllm.py can shadow the package).
SCRIPT = r'''
import json, os, random, sys
algo, out = sys.argv[1], sys.argv[2]
from vllm.utils import hashing
if algo.startswith("xxhash") and hashing._xxhash is None:
    json.dump({"unavailable": "xxhash is not installed"}, open(out, "w"))
    sys.exit(0)
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from lmshm.integrations.adapter import Namespace, chunk_keys_from_hashes

BLOCK, TOKENS, (IMG_AT, IMG_LEN), EDIT = %(block)d, %(tokens)d, %(image)r, %(edit)d
hash_fn = hashing.get_hash_fn_by_name(algo)
init_none_hash(hash_fn)                       # as vllm/v1/engine/core.py does
hasher = get_request_block_hasher(BLOCK, hash_fn)
namespace = Namespace(model="tiny@", dtype="torch.bfloat16", layout="test-layout", chunk_tokens=BLOCK).digest
r = random.Random(11)
tokens = [r.randrange(1, 500) for _ in range(TOKENS)]
embeds = torch.randn(TOKENS, 16, generator=torch.Generator().manual_seed(0))
edited = embeds.clone()
edited[EDIT:] += 1.0

def image(identifier):
    return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                  mm_position=PlaceholderRange(offset=IMG_AT, length=IMG_LEN), mm_hash=identifier)]

def lora(name, ident, path):
    return LoRARequest(lora_name=name, lora_int_id=ident, lora_path=path)

variants = {
    "plain": {}, "plain_again": {},
    "salt_alice": {"cache_salt": "alice"}, "salt_alice_again": {"cache_salt": "alice"},
    "salt_bob": {"cache_salt": "bob"},
    "lora_a": {"lora_request": lora("a", 1, "/adapters/a")},
    "lora_a_again": {"lora_request": lora("a", 1, "/adapters/a")},
    "lora_b": {"lora_request": lora("b", 2, "/adapters/b")},
    "lora_a_moved": {"lora_request": lora("a", 1, "/adapters/a-v2")},
    "image_x": {"mm_features": image("img-x")}, "image_x_again": {"mm_features": image("img-x")},
    "image_y": {"mm_features": image("img-y")},
    "zeros": {"prompt_token_ids": [0] * TOKENS},
    "embeds": {"prompt_token_ids": None, "prompt_embeds": embeds},
    "embeds_again": {"prompt_token_ids": None, "prompt_embeds": embeds.clone()},
    "embeds_edited": {"prompt_token_ids": None, "prompt_embeds": edited},
}
def keys_of(variants):
    result = {}
    for i, (name, extra) in enumerate(variants.items()):
        kw = {"prompt_token_ids": list(tokens), **extra}
        req = Request(request_id=f"r{i}", sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=hasher, **kw)
        hashes = list(req.block_hashes)
        result[name] = {"blocks": len(hashes),
                        "keys": [k.hex() for k in chunk_keys_from_hashes(namespace, hashes, 1)]}
    return result

report = {"variants": keys_of(variants)}
if algo.startswith("xxhash"):
    # vLLM reads PYTHONHASHSEED when it seeds the chain (init_none_hash): the same request again, seeded
    os.environ["PYTHONHASHSEED"] = "42"
    init_none_hash(hash_fn)
    report["seeded"] = keys_of({"plain": {}})
json.dump(report, open(out, "w"))
''' % {"block": BLOCK, "tokens": TOKENS, "image": IMAGE, "edit": EMBEDS_EDIT}


def _need_vllm() -> None:
    if not VLLM_PYTHON.exists():
        if os.environ.get("LMSHM_SKIP_VLLM") == "1":
            pytest.skip("LMSHM_SKIP_VLLM=1: the real-vLLM tests are off")
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm (scripts/test does), "
                    "or set LMSHM_SKIP_VLLM=1 to skip the real-engine tests")


def _keys_in_processes(tmp_path: Path, algo: str, processes: int = 2) -> list[dict]:
    """Run SCRIPT in ``processes`` separate processes at once, without PYTHONHASHSEED (so Python's
    own string hashing differs between them too)."""
    _need_vllm()
    runs = []
    for i in range(processes):
        out = tmp_path / f"{algo}-{i}.json"
        env = _env(str(tmp_path))
        env.pop("PYTHONHASHSEED", None)
        proc = subprocess.Popen([str(VLLM_PYTHON), "-c", SCRIPT, algo, str(out)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs.append((proc, out))
    results = []
    for proc, out in runs:
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"the hashing script exited {proc.returncode}:\n{log[-6000:]}"
        results.append(json.loads(out.read_text()))
    return results


def _assert_split_at(keys: dict, variant: str, other: str, first: int) -> None:
    """Chunks before ``first`` share their keys; every chunk from ``first`` on differs."""
    a, b = keys[variant], keys[other]
    assert len(a) == len(b) == TOKENS // BLOCK, (variant, other)
    assert a[:first] == b[:first], f"{variant} and {other} should share chunks 0..{first - 1}"
    differ = [i for i in range(first, len(a)) if a[i] != b[i]]
    assert differ == list(range(first, len(a))), \
        f"{variant} and {other} should differ at every chunk from {first} on; they differ at {differ}"


@pytest.fixture(scope="module")
def sha256_runs(tmp_path_factory) -> list[dict]:
    """The script's keys with sha256, from two separate processes without PYTHONHASHSEED."""
    return _keys_in_processes(tmp_path_factory.mktemp("hash-sha256"), "sha256")


def test_cache_salt_and_lora_change_every_chunk_key(sha256_runs):
    keys = {k: v["keys"] for k, v in sha256_runs[0]["variants"].items()}
    for variant in ("salt_alice", "salt_bob", "lora_a", "lora_b", "lora_a_moved"):
        _assert_split_at(keys, variant, "plain", 0)
    _assert_split_at(keys, "salt_alice", "salt_bob", 0)
    _assert_split_at(keys, "lora_a", "lora_b", 0)
    # vLLM hashes the adapter's path with its name: re-pointing a name at new weights shares nothing
    _assert_split_at(keys, "lora_a", "lora_a_moved", 0)


def test_an_image_changes_keys_from_its_first_block_and_shares_the_prefix_before(sha256_runs):
    keys = {k: v["keys"] for k, v in sha256_runs[0]["variants"].items()}
    first_block = IMAGE[0] // BLOCK
    assert first_block == 1
    _assert_split_at(keys, "image_x", "plain", first_block)
    _assert_split_at(keys, "image_x", "image_y", first_block)


def test_prompt_embeddings_are_keyed_by_their_values(sha256_runs):
    keys = {k: v["keys"] for k, v in sha256_runs[0]["variants"].items()}
    # an embeddings prompt holds token ids 0: only the embeddings' hash tells it from real zeros
    _assert_split_at(keys, "embeds", "zeros", 0)
    _assert_split_at(keys, "embeds", "plain", 0)
    _assert_split_at(keys, "embeds_edited", "embeds", EMBEDS_EDIT // BLOCK)


def test_the_same_request_gets_the_same_keys_in_one_process_and_in_another(sha256_runs):
    first, second = (run["variants"] for run in sha256_runs)
    assert all(v["blocks"] == TOKENS // BLOCK for v in first.values())
    for name in ("plain", "salt_alice", "lora_a", "image_x", "embeds"):
        assert first[name]["keys"] == first[f"{name}_again"]["keys"], name
    # two processes, each with its own random Python hash seed: sha256 keys agree, every variant
    assert first == second
    distinct = {tuple(v["keys"]) for name, v in first.items() if not name.endswith("_again")}
    assert len(distinct) == len([n for n in first if not n.endswith("_again")])


def test_xxhash_block_hashes_differ_between_processes_unless_seeded(tmp_path):
    """Why the connector refuses ``prefix_caching_hash_algo=xxhash``: without PYTHONHASHSEED, vLLM
    seeds xxhash's chain with random bytes per process, so two engines never share a key."""
    _need_vllm()
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import xxhash; xxhash.xxh3_128_digest"], cwd=tmp_path,
                           capture_output=True)
    if probe.returncode:
        pytest.skip(f"xxhash (with xxh3_128_digest) is not installed in {VLLM_PYTHON}")
    first, second = _keys_in_processes(tmp_path, "xxhash")
    assert "unavailable" not in first, first
    a, b = first["variants"]["plain"]["keys"], second["variants"]["plain"]["keys"]
    assert all(x != y for x, y in zip(a, b)), "unseeded xxhash keys should differ between processes at every chunk"
    assert first["seeded"] == second["seeded"], "with one PYTHONHASHSEED, xxhash keys should agree"
