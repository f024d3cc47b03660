"""KV lookups for routers: ``POST /v1/kv/lookup`` and ``GET /v1/kv/lookup`` on lmshm-server's
HTTP endpoint (``lmshm/endpoints/kv_lookup.py``).

A real server with ``--http-port`` takes STOREs with adverts (the engine's block hashes and
tokens) from an MPClient with a CPU KV cache; a real HTTP client asks how many leading blocks
of a prompt each tier can serve, by block hashes (ints in either signedness, hex bytes) and by
token ids. Whole chunks only; counts drop when the pool evicts; a chunk on disk only counts for
the disk and for the whole. Every malformed request is a 400 that says what is wrong, and the
server serves on. The walk itself (any tier, across lock windows) is checked in process too."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import hashlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from attacks import free_port
from harness import ServerProcess, wait_for

from lmshm.core.kv_events import KvIndex
from lmshm.endpoints import kv_lookup
from lmshm.transport.client import MPClient
from lmshm.wire import protocol

SPACE = b"S"
BLOCK = 2                      # the pretend engine's block size, in tokens
PER_CHUNK = 2                  # engine blocks per lmshm chunk
U64 = 1 << 64


def hashes_of(c: int) -> list[int]:
    """Chunk ``c``'s engine block hashes: unsigned 64-bit ints above 2**63, as vLLM's low 64 bits
    of a sha256 often are (so their signed form differs)."""
    return [(1 << 63) + 1000 * c + j for j in range(PER_CHUNK)]


def tokens_of(c: int) -> list[int]:
    return list(range(100 * c, 100 * c + PER_CHUNK * BLOCK))


def chain(n: int) -> list[int]:
    return [h for c in range(n) for h in hashes_of(c)]


def chain_tokens(n: int) -> list[int]:
    return [t for c in range(n) for t in tokens_of(c)]


def advert(c: int, hashes: Optional[list] = None, parent: Any = "chain", tokens: Optional[list] = None
           ) -> protocol.Advert:
    hashes = hashes if hashes is not None else hashes_of(c)
    if parent == "chain":
        parent = hashes_of(c - 1)[-1] if c else None
    return protocol.Advert(chunk=hashlib.sha256(repr(hashes).encode()).digest(), group=0, block_size=BLOCK,
                           block_hashes=hashes, parent_block_hash=parent,
                           token_ids=tokens if tokens is not None else tokens_of(c))


class Engine:
    """An MPClient with one CPU KV cache (16 blocks) that STOREs chunks with adverts."""

    def __init__(self, url: str) -> None:
        self.kv = torch.zeros(16, 4, 64)
        self.client = MPClient(url, client_name="kv-lookup-test", timeout_s=10)
        self.iid = self.client.register_kv_caches({"l0": self.kv}, "w0", model_name="m")
        self.n = 0

    def store(self, adverts: list[protocol.Advert]) -> None:
        keys = [(self.n + i).to_bytes(4, "big") + bytes(28) for i in range(len(adverts))]
        blocks = [(self.n + i) % 16 for i in range(len(adverts))]
        self.n += len(adverts)
        reply = self.client.store(self.iid, keys, blocks, 1, adverts=adverts, space=SPACE, pod="pod0")
        assert all(r == protocol.StoreResult.STORED for r in reply.results), reply

    def written_through(self, n: int) -> None:
        """Wait until the disk took ``n`` chunks and the pool holds no write-through pin (a pinned
        chunk is never evicted: the next STORE would find no room)."""
        def done() -> bool:
            pool = self.client.status().pool
            disk = next(t for t in pool.tiers if t.name == "disk")
            return disk.puts + disk.drops >= n and pool.pinned == 0
        wait_for(done, 20, what=f"{n} write-through(s) to the disk")

    def close(self) -> None:
        self.client.close()
        del self.kv
        gc.collect()


class Http:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: Optional[bytes] = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        return status, (json.loads(raw) if raw else None)

    def lookup(self, **body: Any) -> dict:
        status, reply = self.call("POST", kv_lookup.PATH, json.dumps(body).encode())
        assert status == 200, reply
        return reply

    def leading(self, **body: Any) -> tuple[int, dict[str, int]]:
        """``(leading blocks from any tier, {tier: leading blocks})``."""
        r = self.lookup(**body)
        return r["leading_blocks"], {t: v["leading_blocks"] for t, v in r["tiers"].items()}

    def refused(self, body: bytes, method: str = "POST") -> str:
        status, reply = self.call(method, kv_lookup.PATH, body)
        assert status == 400, (status, reply, body[:80])
        return reply["error"]


@contextlib.contextmanager
def serving(tmp_path: Path, *args: str) -> Iterator[tuple[ServerProcess, Engine, Http]]:
    port = free_port()
    server = ServerProcess(tmp_path, "--capacity", "64MiB", "--http-port", str(port), *args)
    engine = None
    try:
        engine = Engine(server.url)
        yield server, engine, Http(port)
    finally:
        if engine is not None:
            engine.close()
        assert server.stop() == 0, server.log()


# ---- what a lookup answers ----------------------------------------------------------------


def test_leading_blocks_by_block_hashes_count_whole_chunks_and_stop_where_the_prompt_diverges(tmp_path):
    with serving(tmp_path, "--max-objects", "4") as (server, engine, http):
        engine.store([advert(c) for c in range(3)])                     # 3 chunks: 6 blocks
        r = http.lookup(block_hashes=chain(3))
        assert r["server_id"] == engine.client.server_id and r["node"] == socket.gethostname()
        assert r["blocks"] == 6 and r["leading_blocks"] == 6
        assert r["tiers"] == {"pool": {"medium": "CPU", "locality": "LOCAL", "leading_blocks": 6}}
        assert "leading_tokens" not in r
        assert http.leading(block_hashes=chain(3) + [12345, 678]) == (6, {"pool": 6})   # more than it holds
        assert http.leading(block_hashes=chain(3)[:5]) == (4, {"pool": 4})    # chunk 2's first block only
        assert http.leading(block_hashes=chain(2) + [7, 8]) == (4, {"pool": 4})       # diverges at chunk 2
        assert http.leading(block_hashes=chain(1) + [hashes_of(1)[0], 9]) == (2, {"pool": 2})  # inside chunk 1
        assert http.leading(block_hashes=[]) == (0, {"pool": 0})
        # the same hashes as signed 64-bit ints, as some routers keep them
        assert http.leading(block_hashes=[h - U64 for h in chain(3)]) == (6, {"pool": 6})
        r = http.lookup(block_hashes=chain(2), block_size=BLOCK)
        assert (r["leading_blocks"], r["block_size"], r["leading_tokens"]) == (4, BLOCK, 4 * BLOCK)


def test_leading_blocks_by_token_ids_count_whole_blocks_of_whole_chunks(tmp_path):
    with serving(tmp_path) as (server, engine, http):
        engine.store([advert(c) for c in range(3)])
        r = http.lookup(token_ids=chain_tokens(3), block_size=BLOCK)
        assert (r["blocks"], r["leading_blocks"], r["leading_tokens"], r["block_size"]) == (6, 6, 12, BLOCK)
        assert r["tiers"]["pool"]["leading_blocks"] == 6
        assert http.leading(token_ids=chain_tokens(3) + [5], block_size=BLOCK)[0] == 6    # + half a block
        assert http.leading(token_ids=chain_tokens(3)[:10], block_size=BLOCK)[0] == 4     # chunk 2 half there
        diverged = chain_tokens(3)
        diverged[5] = 99999                                             # block 2, chunk 1's first
        assert http.leading(token_ids=diverged, block_size=BLOCK) == (2, {"pool": 2})
        assert http.leading(token_ids=chain_tokens(3), block_size=4)[0] == 0    # not the engine's block size
        assert http.leading(token_ids=[], block_size=BLOCK)[0] == 0


def test_a_lookup_by_tokens_matches_only_the_lora_and_cache_salt_it_names(tmp_path):
    """Four chunks of the same tokens, stored for no LoRA, LoRA "a", cache salt "s" and an image:
    vLLM's hashes differ, its events' extra keys say why (``to_event_extra_keys``). A lookup by
    tokens counts the chunk it names, and none for a LoRA or salt nobody stored; the image's
    chunk only by its hashes (its tokens are placeholders that cannot name it)."""
    import msgspec

    tokens = tokens_of(0)
    stored = {
        "plain": (None, None),
        "lora": ("a", [["a"], ["a"]]),
        "salt": (None, [["s"], None]),
        "lora+salt": ("a", [["a", "s"], ["a"]]),
        "image": (None, [[["img0", 0]], [["img0", 2]]]),
    }
    hashes = {name: [(1 << 62) + 10 * i + j for j in range(PER_CHUNK)] for i, name in enumerate(stored)}
    with serving(tmp_path) as (server, engine, http):
        ads = []
        for name, (lora, extra) in stored.items():
            ad = advert(0, hashes=hashes[name], parent=None, tokens=tokens)
            ads.append(msgspec.structs.replace(ad, lora_name=lora,
                                               extra_keys=msgspec.msgpack.encode(extra) if extra else None))
        engine.store(ads)

        def by_tokens(**named: Any) -> int:
            return http.leading(token_ids=tokens, block_size=BLOCK, **named)[0]

        assert by_tokens() == 2
        assert by_tokens(lora_name="a") == 2
        assert by_tokens(cache_salt="s") == 2
        assert by_tokens(lora_name="a", cache_salt="s") == 2
        assert by_tokens(lora_name=None, cache_salt=None) == 2
        assert by_tokens(lora_name="b") == 0
        assert by_tokens(cache_salt="t") == 0
        assert by_tokens(cache_salt="img0") == 0
        for name in stored:
            assert http.leading(block_hashes=hashes[name])[0] == 2, name
        # each named lookup found its own chunk's hashes: evict nothing, but ask for a longer
        # prompt whose second chunk chains only under the LoRA chunk
        engine.store([advert(1, hashes=[(1 << 61) + j for j in range(PER_CHUNK)], parent=hashes["lora"][-1],
                             tokens=tokens_of(1))])
        longer = tokens + tokens_of(1)
        assert http.leading(token_ids=longer, block_size=BLOCK, lora_name="a")[0] == 2   # ("a" not on chunk 1)
        assert http.leading(token_ids=longer, block_size=BLOCK)[0] == 2


def test_bytes_hashes_match_as_hex_and_int_hashes_match_the_hex_of_the_bytes_they_came_from(tmp_path):
    digests = [hashlib.sha256(b"block %d" % j).digest() for j in range(4)]
    others = [hashlib.sha256(b"other %d" % j).digest() for j in range(2)]
    as_int = [int.from_bytes(d, "big") & (U64 - 1) for d in digests + others]   # vLLM's maybe_convert_block_hash
    with serving(tmp_path) as (server, engine, http):
        engine.store([advert(0, hashes=digests[:2], parent=None),       # an engine with bytes hashes
                      advert(1, hashes=digests[2:], parent=digests[1]),
                      advert(2, hashes=as_int[4:], parent=None, tokens=[7] * 4)])   # one with int hashes
        assert http.leading(block_hashes=[d.hex() for d in digests]) == (4, {"pool": 4})
        assert http.leading(block_hashes=[d.hex().upper() for d in digests]) == (4, {"pool": 4})
        assert http.leading(block_hashes=as_int[:4]) == (0, {"pool": 0})          # those are kept as bytes
        assert http.leading(block_hashes=as_int[4:]) == (2, {"pool": 2})
        assert http.leading(block_hashes=[d.hex() for d in others]) == (2, {"pool": 2})   # hex of the int's bytes


def test_counts_drop_when_the_pool_evicts_the_first_chunk(tmp_path):
    with serving(tmp_path, "--max-objects", "4") as (server, engine, http):
        engine.store([advert(c) for c in range(4)])
        assert http.leading(block_hashes=chain(4)) == (8, {"pool": 8})
        assert http.leading(token_ids=chain_tokens(4), block_size=BLOCK)[0] == 8
        engine.store([advert(9, parent=None)])        # --max-objects 4: chunk 0, the oldest, goes
        wait_for(lambda: http.leading(block_hashes=chain(4)) == (0, {"pool": 0}), 5, 0.05, "chunk 0 evicted")
        assert http.leading(token_ids=chain_tokens(4), block_size=BLOCK)[0] == 0
        assert http.leading(block_hashes=hashes_of(9)) == (2, {"pool": 2})


def test_a_chunk_on_disk_only_counts_for_the_disk_and_for_lmshm_as_a_whole(tmp_path):
    with serving(tmp_path, "--max-objects", "2", "--disk", str(tmp_path / "disk"), "--disk-capacity", "64MiB"
                 ) as (server, engine, http):
        for c in range(3):                   # the pool (2 objects) evicts chunk 0; the disk has all
            engine.store([advert(c)])
            engine.written_through(c + 1)
        want = (6, {"pool": 0, "disk": 6})
        wait_for(lambda: http.leading(block_hashes=chain(3)) == want, 10, 0.05, "all three on disk")
        r = http.lookup(block_hashes=chain(3))
        assert r["tiers"]["disk"] == {"medium": "STORAGE", "locality": "LOCAL", "leading_blocks": 6}
        assert http.leading(block_hashes=chain(2) + [7]) == (4, {"pool": 0, "disk": 4})
        status, info = http.call("GET", kv_lookup.PATH)
        assert status == 200 and list(info["tiers"]) == ["pool", "disk"], info


def test_get_answers_the_node_its_tiers_block_sizes_and_limits(tmp_path):
    with serving(tmp_path, "--kv-events-node", "rack1-n3") as (server, engine, http):
        engine.store([advert(0)])
        status, info = http.call("GET", kv_lookup.PATH)
        assert status == 200, info
        assert info["server_id"] == engine.client.server_id and info["node"] == "rack1-n3"
        assert info["tiers"] == {"pool": {"medium": "CPU", "locality": "LOCAL"}}
        assert info["chunks"] == 1 and info["block_sizes"] == [BLOCK]
        assert info["limits"] == {"max_blocks": kv_lookup.MAX_BLOCKS, "max_tokens": kv_lookup.MAX_TOKENS,
                                  "max_block_size": kv_lookup.MAX_BLOCK_SIZE, "max_body_bytes": 64 << 10}
        assert http.lookup(block_hashes=chain(1))["node"] == "rack1-n3"


def test_without_the_kv_event_index_a_lookup_is_404_saying_how_to_turn_it_on(tmp_path):
    with serving(tmp_path, "--kv-events-index", "0") as (server, engine, http):
        engine.store([advert(0)])
        for method, body in (("POST", json.dumps({"block_hashes": chain(1)}).encode()), ("GET", None)):
            status, reply = http.call(method, kv_lookup.PATH, body)
            assert status == 404 and "--kv-events-index" in reply["error"], (status, reply)
        assert http.call("GET", "/v2/health/live")[0] == 200


# ---- what it refuses ----------------------------------------------------------------------

def _j(value: Any) -> bytes:
    return json.dumps(value).encode()


BAD = [
    (b"{not json", "not valid JSON"),
    (b"", "the request body is empty"),
    (b"[1, 2]", "must be a JSON object, got array"),
    (b'"block_hashes"', "must be a JSON object, got string"),
    (b"[" * 200000 + b"]" * 200000, "nests arrays or objects too deeply"),
    (b'{"block_hashes": [' + b"7" * 5000 + b"]}", "not valid JSON"),          # Python's int digit limit
    (_j({}), "not neither"),
    (_j({"block_hashes": [1], "token_ids": [1], "block_size": 2}), "not both"),
    (_j({"block_hashes": [1], "model": "m"}), "'model' is not supported"),
    (_j({"block_hash": [1]}), "unknown field 'block_hash'"),
    (_j({"block_hashes": "00ff"}), "'block_hashes' must be an array, got string"),
    (_j({"block_hashes": {"0": 1}}), "'block_hashes' must be an array, got object"),
    (_j({"block_hashes": [1, 2.5]}), "block_hashes[1] must be an integer or a hex string, got number 2.5"),
    (_j({"block_hashes": [True]}), "block_hashes[0] must be an integer or a hex string, got boolean"),
    (_j({"block_hashes": [None]}), "got null"),
    (_j({"block_hashes": [[1]]}), "got array"),
    (_j({"block_hashes": [-(1 << 63) - 1]}), "is not a 64-bit integer"),
    (_j({"block_hashes": [1 << 64]}), "<int of 65 bits> is not a 64-bit integer"),
    (_j({"block_hashes": [10 ** 400]}), "is not a 64-bit integer"),
    (_j({"block_hashes": ["xyz0"]}), "block_hashes[0] = 'xyz0' is not a hex string"),
    (_j({"block_hashes": ["abc"]}), "is not a hex string"),                 # odd length
    (_j({"block_hashes": ["0x12"]}), "is not a hex string"),
    (_j({"block_hashes": ["ab cd"]}), "is not a hex string"),
    (_j({"block_hashes": [""]}), "is not a hex string"),
    (_j({"block_hashes": ["ab" * 65]}), "is not a hex string of 1 to 64 bytes"),
    (_j({"block_hashes": ["\u0661\u0662"]}), "is not a hex string"),        # Arabic-Indic digits
    (_j({"token_ids": [1, 2]}), "'token_ids' needs 'block_size'"),
    (_j({"token_ids": [1, 2], "block_size": 0}), "'block_size' must be between 1 and 65536"),
    (_j({"token_ids": [1, 2], "block_size": -16}), "'block_size' must be between 1 and 65536"),
    (_j({"token_ids": [1, 2], "block_size": 1 << 20}), "'block_size' must be between 1 and 65536"),
    (_j({"token_ids": [1, 2], "block_size": "16"}), "'block_size' must be an integer, got string"),
    (_j({"token_ids": [1, 2], "block_size": 16.0}), "'block_size' must be an integer, got number"),
    (_j({"token_ids": [1, 2], "block_size": True}), "'block_size' must be an integer, got boolean"),
    (_j({"token_ids": [1, 2], "block_size": None}), "'block_size' must be an integer, got null"),
    (_j({"block_hashes": [1], "block_size": 0}), "'block_size' must be between 1"),
    (_j({"token_ids": "1 2 3", "block_size": 2}), "'token_ids' must be an array"),
    (_j({"token_ids": [1, "2"], "block_size": 2}), "token_ids[1] must be a 32-bit integer token id, got string"),
    (_j({"token_ids": [1, 2.0], "block_size": 2}), "token_ids[1] must be a 32-bit integer token id, got number"),
    (_j({"token_ids": [1 << 31], "block_size": 2}), "token_ids[0] must be a 32-bit integer token id, got "
                                                    "2147483648, out of range"),
    (_j({"token_ids": [-(1 << 31) - 1], "block_size": 2}), "out of range"),
    (_j({"token_ids": [1, 2], "block_size": 2, "lora_name": 7}), "'lora_name' must be a string or null, got integer"),
    (_j({"token_ids": [1, 2], "block_size": 2, "cache_salt": ["s"]}), "'cache_salt' must be a string or null, got "
                                                                      "array"),
    (_j({"token_ids": [1, 2], "block_size": 2, "cache_salt": "s" * 5000}), "'cache_salt' is 5000 characters; at "
                                                                          "most 4096"),
    (_j({"block_hashes": [1], "lora_name": "a"}), "'lora_name' goes with 'token_ids' only"),
    (_j({"block_hashes": [1], "cache_salt": None}), "'cache_salt' goes with 'token_ids' only"),
    # over the caps (the body limit is raised for these: --http-max-body-bytes 16MiB)
    (_j({"block_hashes": [0] * (kv_lookup.MAX_BLOCKS + 1)}), "'block_hashes' has 65537 hashes; a lookup takes "
                                                              "at most 65536"),
    (_j({"token_ids": [0] * (kv_lookup.MAX_TOKENS + 1), "block_size": 16}), "'token_ids' has 1048577 tokens"),
    (_j({"token_ids": [0] * (kv_lookup.MAX_BLOCKS + 1), "block_size": 1}), "65537 tokens are 65537 blocks of 1; "
                                                                           "a lookup takes at most 65536 blocks"),
]


def test_every_malformed_lookup_is_a_400_that_says_what_is_wrong_and_the_server_serves_on(tmp_path):
    with serving(tmp_path, "--http-max-body-bytes", str(16 << 20)) as (server, engine, http):
        engine.store([advert(c) for c in range(2)])
        problems = []
        for body, words in BAD:
            error = http.refused(body)
            if words not in error:
                problems.append((body[:60], words, error))
        assert not problems, "\n".join(map(repr, problems))
        status, reply = http.call("PUT", kv_lookup.PATH, _j({"block_hashes": [1]}))
        assert status == 405 and "use GET, HEAD, POST" in reply["error"], reply
        assert http.leading(block_hashes=chain(2)) == (4, {"pool": 4})        # still serving, still right
        assert http.call("GET", "/v2/health/live")[0] == 200
        errors = [line for line in http_metrics(http) if line.startswith("lmshm_requests_total")
                  and 'request="KvLookup"' in line and 'code="INVALID_ARG"' in line]
        assert len(errors) == 1 and float(errors[0].split()[-1]) == len(BAD), errors    # counted as refused
    assert "Traceback" not in server.log()


def test_a_body_over_the_endpoints_limit_is_a_400_naming_the_setting(tmp_path):
    with serving(tmp_path) as (server, engine, http):      # --http-max-body-bytes: 64 KiB by default
        error = http.refused(_j({"block_hashes": [(1 << 63) + i for i in range(4000)]}))   # about 84 KB
        assert "larger than 65536 bytes" in error and "--http-max-body-bytes" in error, error
        assert http.leading(block_hashes=[(1 << 63) + i for i in range(2000)])[0] == 0     # about 42 KB: fine


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _post_raw(port: int, body: bytes) -> tuple[Any, Optional[str], bytes]:
    """``(status, Retry-After, answer)`` of one lookup on a connection of its own; status is the
    exception's name when the server did not answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", kv_lookup.PATH, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Retry-After"), r.read()
    except OSError as exc:
        return type(exc).__name__, None, b""
    finally:
        conn.close()


def test_concurrent_largest_lookups_hold_a_bounded_number_of_bytes_and_the_rest_are_told_to_retry(tmp_path):
    """Issue 41, item 3: 48 concurrent lookups of 12 MiB (a million 10-digit token ids, under the
    16 MiB limit) were all read and held while they waited their turn: +0.9 GiB. Now the bodies
    held, read or waiting, are bounded (``kv_lookup.BYTES_HELD``); past it a lookup is answered
    503 with Retry-After without its body being kept, and every lookup is answered."""
    body = _j({"token_ids": [(1 << 31) - 1] * kv_lookup.MAX_TOKENS, "block_size": 16})
    assert 12 << 20 < len(body) < 16 << 20
    with serving(tmp_path, "--http-max-body-bytes", str(16 << 20)) as (server, engine, http):
        port = int(http.base.rsplit(":", 1)[1])
        assert _post_raw(port, body)[0] == 200       # the largest lookup works alone
        before = _peak_rss_kb(server.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            answers = list(pool.map(lambda _: _post_raw(port, body), range(48)))
        grown_mib = (_peak_rss_kb(server.proc.pid) - before) / 1024
        statuses = collections.Counter(a[0] for a in answers)
        assert set(statuses) <= {200, 503} and statuses[200] >= 1, statuses
        assert all(a[1] == str(kv_lookup.RETRY_AFTER_S) and b"try again" in a[2] for a in answers if a[0] == 503)
        assert grown_mib < 200, (f"the server's peak RSS grew {grown_mib:.0f} MiB for 48 lookups", statuses)
        assert http.leading(block_hashes=chain(2)) == (0, {"pool": 0})     # served on
    assert "Traceback" not in server.log()


def http_metrics(http: Http) -> list[str]:
    with urllib.request.urlopen(http.base + "/metrics", timeout=10) as r:
        return r.read().decode().splitlines()


# ---- the walk, in process -------------------------------------------------------------------


class _Adv:
    def __init__(self, c: int, hashes: list, parent: Any, tokens: list, block_size: int = 1) -> None:
        self.chunk, self.group, self.block_size = b"c%d" % c, 0, block_size
        self.block_hashes, self.parent_block_hash, self.token_ids = hashes, parent, tokens
        self.lora_name = self.extra_keys = None


def _index(chunks: list[tuple[list, set[str]]]) -> KvIndex:
    """An index holding ``chunks`` (hashes, tiers holding it), chained in order."""
    index = KvIndex()
    parent = None
    for c, (hashes, tiers) in enumerate(chunks):
        key = b"k%d" % c
        index.describe(1, SPACE, "m", "pod0", 0, 1, [key], [_Adv(c, hashes, parent, list(hashes))])
        for tier in tiers:
            index.note(1, key, tier, True)
        parent = hashes[-1]
    return index


def test_a_block_counts_for_lmshm_as_a_whole_when_any_tier_serves_its_chunk_not_only_the_best_tier():
    # chunk 0 in the pool only, 1 on disk only, 2 in both, 3 on the remote only, 4 nowhere
    tiers = ["pool", "disk", "remote"]
    chunks = [([1, 2], {"pool"}), ([3, 4], {"disk"}), ([5, 6], {"pool", "disk"}), ([7], {"remote"}),
              ([8, 9], set())]
    index = _index(chunks)
    hashes = [h for hs, _ in chunks for h in hs]
    r = kv_lookup.lookup(index, tiers, "hashes", hashes, None)
    assert {t: v["leading_blocks"] for t, v in r["tiers"].items()} == {"pool": 2, "disk": 0, "remote": 0}
    assert r["leading_blocks"] == 7 and r["blocks"] == 9
    r = kv_lookup.lookup(index, tiers, "tokens", hashes, 1)      # the tokens are the hashes here
    assert r["leading_blocks"] == 7 and r["leading_tokens"] == 7
    assert kv_lookup.lookup(index, tiers, "hashes", hashes[:5], None)["leading_blocks"] == 4   # chunk 2 cut


def test_a_long_prefix_is_walked_window_by_window_with_chunks_that_cross_the_windows():
    # chunks of 1000 blocks: the first window (4096 blocks) ends inside chunk 4
    hashes = list(range(1, 8 * 1000 + 1))
    chunks = [(hashes[i:i + 1000], {"pool", "disk"} if i < 5000 else {"disk"}) for i in range(0, len(hashes), 1000)]
    index = _index(chunks)
    calls = []
    leading = index.leading
    index.leading = lambda h, t: calls.append(len(h)) or leading(h, t)   # type: ignore[method-assign]
    r = kv_lookup.lookup(index, ["pool", "disk"], "hashes", hashes + [0], None)
    assert {t: v["leading_blocks"] for t, v in r["tiers"].items()} == {"pool": 5000, "disk": 8000}
    assert r["leading_blocks"] == 8000
    assert max(calls) <= kv_lookup.WINDOW            # the lock is held for a window at most


def test_a_lookup_of_the_most_blocks_is_quick():
    hashes = list(range(1, kv_lookup.MAX_BLOCKS + 1))
    index = _index([(hashes[i:i + 1024], {"pool", "disk", "remote"}) for i in range(0, len(hashes), 1024)])
    started = time.monotonic()
    body = json.dumps({"block_hashes": [(1 << 63) + h for h in hashes]}).encode()
    r = kv_lookup.lookup(index, ["pool", "disk", "remote"], *kv_lookup.check_request(kv_lookup.parse_body(body)))
    assert r["leading_blocks"] == 0                  # stored as small ints: none of the forms matches
    r = kv_lookup.lookup(index, ["pool", "disk", "remote"], "hashes", hashes, None)
    assert r["leading_blocks"] == kv_lookup.MAX_BLOCKS
    assert time.monotonic() - started < 2.0


def test_hash_forms_try_ints_as_given_unsigned_and_signed_and_bytes_as_vllms_int():
    assert kv_lookup.hash_forms([1, 2]) == [[1, 2]]
    assert kv_lookup.hash_forms([-1]) == [[-1], [U64 - 1]]
    assert kv_lookup.hash_forms([U64 - 1]) == [[U64 - 1], [-1]]
    b = bytes(24) + (5).to_bytes(8, "big")
    assert kv_lookup.hash_forms([b]) == [[b], [5]]
    big = bytes(24) + (U64 - 2).to_bytes(8, "big")
    assert kv_lookup.hash_forms([big, 7]) == [[big, 7], [U64 - 2, 7], [-2, 7]]


def test_a_long_lookup_is_decoded_in_slices_to_what_json_reads_and_refused_as_json_refuses_it():
    """``kv_lookup.parse_body`` decodes a million token ids ``SLICE_BYTES`` at a time (so the
    GIL is never held for the whole body); the result is json's, whatever the spacing, and what
    is not a plain array of integers goes the whole way, with json's errors."""
    tokens = [(-1) ** i * (i * 7919 % (1 << 31)) for i in range(1 << 20)]
    for body in ({"token_ids": tokens, "block_size": 16, "lora_name": "a,b"},
                 {"block_size": 16, "token_ids": tokens[:70000], "cache_salt": None}):
        for raw in (json.dumps(body).encode(), json.dumps(body, separators=(",", ":")).encode(),
                    json.dumps(body, indent=1).encode()):
            assert len(raw) > kv_lookup.SLICE_BYTES and kv_lookup.parse_body(raw) == json.loads(raw)
    pad = b" " * (2 * kv_lookup.SLICE_BYTES)
    for raw, words in ((b'{"token_ids": [1,,2], "block_size": 1}' + pad, "not valid JSON"),
                       (b'{"token_ids": [1, 2]' + pad, "not valid JSON"),
                       (b"[" + b"1," * kv_lookup.SLICE_BYTES + b"1]", "must be a JSON object, got array")):
        try:
            kv_lookup.parse_body(raw)
        except Exception as exc:
            assert words in str(exc), (words, str(exc)[:200])
        else:
            raise AssertionError(f"{raw[:40]!r} was accepted")
    big = b'{"token_ids": [' + b"1, " * kv_lookup.SLICE_BYTES + b"1" + b"0" * 30 + b'], "block_size": 1}'
    assert kv_lookup.parse_body(big)["token_ids"][-1] == 10 ** 30       # json's integer; check_request refuses it
    assert kv_lookup.parse_body(big.replace(b"1, 1", b"1, 1.5", 1))["token_ids"][1] == 1.5


def test_lookups_that_declare_large_bodies_and_send_nothing_cannot_keep_honest_lookups_out(tmp_path):
    """Round 4, fresh attack: a client that declares the largest bodies (Content-Length 9 MiB)
    and sends none of them took all of ``kv_lookup.BYTES_HELD`` for a whole
    ``--http-request-timeout``; opening such a lookup every 20 ms, it kept it taken, and 99% of an
    honest router's lookups were told 503 for as long as it went on. A body still arriving now
    gives way (``kv_lookup.GIVE_WAY_S``), at once to a lookup whose body is all here."""
    limit = kv_lookup.LARGEST_BODY
    head = (f"POST {kv_lookup.PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit}\r\n\r\n{{").encode()
    with serving(tmp_path, "--http-max-body-bytes", str(limit)) as (server, engine, http):
        port = int(http.base.rsplit(":", 1)[1])
        stop, held = False, collections.deque()

        def hold() -> None:
            while not stop:
                with contextlib.suppress(OSError):
                    s = socket.create_connection(("127.0.0.1", port))
                    s.sendall(head)
                    held.append((time.monotonic(), s))
                while held and held[0][0] < time.monotonic() - 6:
                    held.popleft()[1].close()
                time.sleep(0.02)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            attacker = pool.submit(hold)
            try:
                time.sleep(0.5)
                body, statuses, until = _j({"block_hashes": chain(2)}), collections.Counter(), time.monotonic() + 6
                while time.monotonic() < until:
                    statuses[_post_raw(port, body)[0]] += 1
                    time.sleep(0.05)
            finally:
                stop = True
                attacker.result()
                for _, s in held:
                    s.close()
        answered = statuses[200] / sum(statuses.values())
        assert answered >= 0.8, f"only {answered:.0%} of honest lookups were answered: {dict(statuses)}"
        assert http.leading(block_hashes=chain(2)) == (0, {"pool": 0})     # served on
    assert "Traceback" not in server.log()


def test_where_lookup_bytes_are_full_the_slowest_body_still_arriving_gives_way():
    """``KvLookup.admit`` (in process): a body all here takes the place of one still arriving at
    once, one still arriving only after ``GIVE_WAY_S``; the one that gives way is the slowest to
    arrive, never a body that has arrived, so stalled bodies cannot pick off an honest one."""
    import asyncio
    import types

    def request(length: int, sent: int) -> Any:
        return types.SimpleNamespace(content_length=length, content=types.SimpleNamespace(total_bytes=sent))

    async def run() -> None:
        lookups, big = kv_lookup.KvLookup(None), kv_lookup.LARGEST_BODY
        stalled = [lookups.admit(request(big, 1), big, False, 0.0) for _ in range(3)]
        honest = lookups.admit(request(big, 8 << 20), big, False, 0.0)       # 8 MiB of it here already
        assert None not in stalled and honest is not None and lookups.held == kv_lookup.BYTES_HELD
        assert lookups.admit(request(big, 1), big, False, 0.5) is None      # nobody has waited GIVE_WAY_S
        small = lookups.admit(request(100, 100), big, True, 0.5)            # all here: in at once
        assert small is not None and [t.evicted.done() for t in stalled] == [True, False, False]
        later = lookups.admit(request(big, 1), big, False, kv_lookup.GIVE_WAY_S + 0.5)
        assert later is not None and [t.evicted.done() for t in stalled] == [True, True, False]
        assert not honest.evicted.done() and not small.evicted.done()
        lookups.arrived(honest)
        for t in (*stalled, honest, small, later):
            lookups.release(t)
        assert lookups.held == 0

    asyncio.run(run())


def test_routes_other_than_lookups_read_no_large_bodies_whatever_the_limit_for_lookups(tmp_path):
    """Round 4, fresh attack: ``--http-max-body-bytes 9437184`` (what docs/kv-lookup.md
    recommends for lookups by tokens) let every route read that much per connection, and only
    ``POST /v1/kv/lookup`` takes its bytes from ``kv_lookup.BYTES_HELD``: 48 connections sending
    8 MiB of 9 MiB bodies to ``GET /v2/health/live`` or ``POST .../unregister`` held 390 MiB
    (the same to the lookup route: 42 MiB). Other routes now read at most
    ``http.OTHER_MAX_BODY`` (64 KiB); a larger body is a 400 that says so."""
    from lmshm.endpoints.http import OTHER_MAX_BODY

    size = kv_lookup.LARGEST_BODY
    with serving(tmp_path, "--http-max-body-bytes", str(size)) as (server, engine, http):
        port = int(http.base.rsplit(":", 1)[1])
        before = _peak_rss_kb(server.proc.pid)
        socks, chunk = [], b"7" * (1 << 20)
        try:
            for i in range(48):
                method, path = ("GET", "/v2/health/live") if i % 2 else ("POST", "/v2/systemsharedmemory/unregister")
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                socks.append(s)
                with contextlib.suppress(OSError):
                    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {size}\r\n\r\n".encode())
                    for _ in range(8):
                        s.sendall(chunk)
            time.sleep(1.0)
            grown_mib = (_peak_rss_kb(server.proc.pid) - before) / 1024
        finally:
            for s in socks:
                s.close()
        assert grown_mib < 100, f"the server's peak RSS grew {grown_mib:.0f} MiB for 48 bodies to routes that need none"
        status, reply = http.call("POST", "/v2/systemsharedmemory/unregister", b"x" * (OTHER_MAX_BODY + 1))
        assert status == 400 and f"larger than {OTHER_MAX_BODY} bytes" in reply["error"], reply
        assert http.call("POST", "/v2/systemsharedmemory/unregister", b"")[0] == 200
        big = _j({"block_hashes": [(1 << 63) + i for i in range(kv_lookup.MAX_BLOCKS)]})
        assert len(big) > 1 << 20 and _post_raw(port, big)[0] == 200        # lookups still may send large bodies
    assert "Traceback" not in server.log()
