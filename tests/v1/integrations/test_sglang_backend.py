"""``lmshm.integrations.sglang`` without SGLang: it imports, and its page and config checks refuse
what they must. (SGLang's own code drives it in test_sglang.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_the_backend_module_imports_without_sglang():
    code = ("import sys, lmshm.integrations.sglang as m; "
            "assert 'sglang' not in sys.modules; assert m.LmshmHiCacheStorage.__mro__[1] is object; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_page_ids_take_whole_aligned_pages_only():
    from lmshm.integrations.sglang import page_ids

    idx = torch.cat([torch.arange(8, 12), torch.arange(20, 24)]).to(torch.int64)
    assert page_ids(idx, 4, 2) == [2, 5]
    with pytest.raises(ValueError, match="aligned"):
        page_ids(torch.arange(9, 17, dtype=torch.int64), 4, 2)      # straddles two pages
    with pytest.raises(ValueError, match="aligned"):
        page_ids(torch.tensor([8, 9, 11, 10], dtype=torch.int64), 4, 1)   # a page out of order
    with pytest.raises(ValueError, match="slots"):
        page_ids(torch.arange(0, 8, dtype=torch.int64), 4, 3)        # fewer slots than pages say


def test_unknown_or_mistyped_lmshm_keys_stop_the_engine_with_the_known_keys():
    from lmshm.integrations.sglang import _read_config

    assert _read_config({"lmshm.url": "tcp://x:1", "allocator": "shm", "interface_v1": 1}) == {"lmshm.url": "tcp://x:1"}
    with pytest.raises(ValueError, match="lmshm.url"):
        _read_config({"lmshm.ulr": "tcp://x:1"})
    with pytest.raises(ValueError, match="lmshm.timeout_s"):
        _read_config({"lmshm.timeout_s": "5"})
