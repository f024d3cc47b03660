"""The common wrapper contract: fields, equality, pickling, safe decoding."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys

import pytest
import torch

from lmshm.platform import wrapper_registry
from lmshm.platform.base import ipc_wrapper
from lmshm.platform.base.ipc_wrapper import (
    DeviceIPCWrapper,
    WrapperDecodeError,
    allowed_wrapper_classes,
    dtype_from_name,
    dtype_name,
)
from lmshm.platform.cpu import CpuFdIPCWrapper, CpuShmIPCWrapper


def _wrapper(**over):
    fields = dict(dtype="float16", shape=(2, 3), stride=(3, 1), storage_offset=0, device="cpu",
                  segment="lmshm-1-abcdef", segment_bytes=12, byte_offset=0)
    fields.update(over)
    return CpuShmIPCWrapper(**fields)


def test_wrappers_compare_by_type_and_fields():
    assert _wrapper() == _wrapper()
    assert hash(_wrapper()) == hash(_wrapper())
    assert _wrapper() != _wrapper(shape=(3, 2), stride=(2, 1))
    fd = CpuFdIPCWrapper(dtype="float16", shape=(2, 3), stride=(3, 1), storage_offset=0, device="cpu",
                         segment="lmshm-1-abcdef", segment_bytes=12, byte_offset=0)
    assert fd != _wrapper(), "same fields, different kind: not equal"


def test_wrapper_pickles_with_its_concrete_class():
    w = _wrapper(dtype="bfloat16")
    back = DeviceIPCWrapper.Deserialize(w.Serialize())
    assert type(back) is CpuShmIPCWrapper
    assert back == w
    assert back.torch_dtype is torch.bfloat16


def test_close_is_idempotent():
    w = _wrapper()
    w.close()
    w.close()
    assert w.closed


class _RunsShell:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lmshm-pwned-marker",))


def test_pickle_that_would_run_a_command_is_refused_and_runs_nothing():
    marker = "/tmp/lmshm-pwned-marker"
    if os.path.exists(marker):
        os.unlink(marker)
    payload = pickle.dumps(_RunsShell())
    with pytest.raises(WrapperDecodeError, match="refusing to unpickle (posix|os).system"):
        DeviceIPCWrapper.Deserialize(payload)
    assert not os.path.exists(marker)


def test_pickle_of_a_plain_object_is_refused():
    with pytest.raises(WrapperDecodeError, match="not an lmshm wrapper"):
        DeviceIPCWrapper.Deserialize(pickle.dumps({"a": 1}))


def test_pickle_naming_a_method_of_an_allowed_class_is_refused():
    # GLOBAL with a dotted qualname would resolve attributes of an allowed class.
    payload = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x1flmshm.platform.cpu.wrappers\x94\x8c\x19CpuShmIPCWrapper.to_tensor\x94\x93\x94."
    with pytest.raises(WrapperDecodeError):
        DeviceIPCWrapper.Deserialize(payload)


def test_truncated_and_random_bytes_give_a_decode_error():
    good = _wrapper().Serialize()
    for cut in (1, len(good) // 2, len(good) - 1):
        with pytest.raises(WrapperDecodeError):
            DeviceIPCWrapper.Deserialize(good[:cut])
    rng = random.Random(1234)
    for _ in range(200):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        with pytest.raises(WrapperDecodeError):
            DeviceIPCWrapper.Deserialize(blob)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("dtype", "object", "unknown dtype"),
        ("shape", (2, -3), r"ints in \[0, 2\*\*48\]"),
        ("shape", [1] * 40, "at most"),
        ("stride", (1,), "differ in rank"),
        ("storage_offset", -1, "storage_offset"),
        ("segment", "../../etc/passwd", "invalid segment name"),
        ("segment_bytes", 1 << 70, "segment_bytes"),
    ],
)
def test_peer_state_is_validated(field, value, match):
    # A forged payload: a genuine wrapper class with one field set to a hostile value.
    forged = CpuShmIPCWrapper.__new__(CpuShmIPCWrapper)
    forged.__dict__.update(_wrapper().__getstate__())
    forged.__dict__[field] = value
    payload = pickle.dumps(forged)
    with pytest.raises(WrapperDecodeError, match=match):
        DeviceIPCWrapper.Deserialize(payload)


def test_state_with_extra_or_missing_fields_is_refused():
    w = _wrapper()
    state = w.__getstate__()
    obj = CpuShmIPCWrapper.__new__(CpuShmIPCWrapper)
    with pytest.raises(WrapperDecodeError, match="exactly the fields"):
        obj.__setstate__({**state, "__class__": "x"})
    state.pop("segment")
    with pytest.raises(WrapperDecodeError, match="exactly the fields"):
        obj.__setstate__(state)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int8])
def test_dtype_names_round_trip(dt):
    assert dtype_from_name(dtype_name(dt)) is dt


def test_unknown_dtype_name_lists_the_supported_ones():
    with pytest.raises(ValueError, match="unknown dtype 'float128'.*bfloat16"):
        dtype_from_name("float128")


# ---- the explicit allow-list (lmshm/platform/wrapper_registry.py) -----------------------------

class _UnlistedWrapper(CpuShmIPCWrapper):
    """A subclass defined outside the allow-list: inheriting must not make it decodable."""

    kind = "cpu-unlisted"


def test_a_subclass_that_is_not_on_the_list_is_refused():
    payload = _UnlistedWrapper(**_wrapper().__getstate__()).Serialize()
    with pytest.raises(WrapperDecodeError, match=r"refusing to unpickle \S+\._UnlistedWrapper"):
        DeviceIPCWrapper.Deserialize(payload)
    assert f"{__name__}._UnlistedWrapper" not in allowed_wrapper_classes()


def test_a_subclass_decodes_once_it_is_added_to_the_list(monkeypatch):
    w = _UnlistedWrapper(**_wrapper().__getstate__())
    monkeypatch.setattr(ipc_wrapper, "_ALLOWED", ipc_wrapper._ALLOWED | {(__name__, "_UnlistedWrapper")})
    back = DeviceIPCWrapper.Deserialize(w.Serialize())
    assert type(back) is _UnlistedWrapper and back == w


def test_a_listed_name_that_is_not_a_wrapper_class_is_refused(monkeypatch):
    monkeypatch.setattr(ipc_wrapper, "_ALLOWED", ipc_wrapper._ALLOWED | {(os.getcwd.__module__, "getcwd")})
    with pytest.raises(WrapperDecodeError, match=r"getcwd is on the allow-list but is not an lmshm wrapper"):
        DeviceIPCWrapper.Deserialize(pickle.dumps(os.getcwd))


def test_the_list_names_exactly_the_concrete_wrappers_lmshm_ships():
    import lmshm.platform.cpu
    import lmshm.platform.cuda  # noqa: F401 (the import itself is what is tested)

    def concrete(cls):
        for sub in cls.__subclasses__():
            if sub.kind and sub.__module__.startswith("lmshm."):
                yield sub
            yield from concrete(sub)

    shipped = set(concrete(DeviceIPCWrapper))
    assert set(wrapper_registry.ALLOWED_WRAPPER_CLASSES) == {(c.__module__, c.__qualname__) for c in shipped}
    assert len(shipped) == 5
    assert allowed_wrapper_classes() == sorted(f"{c.__module__}.{c.__qualname__}" for c in shipped)


def test_the_base_package_imports_neither_cpu_nor_cuda():
    code = ("import sys, lmshm.platform.base.ipc_wrapper, lmshm.platform.base.mappings, lmshm.platform.base.fds\n"
            "print(sorted(m for m in sys.modules if m.startswith(('lmshm.platform.cpu', 'lmshm.platform.cuda'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_process_that_imported_only_the_base_decodes_every_listed_kind():
    # The base names the kinds as data; unpickling a listed name imports its module then.
    payload = _wrapper().Serialize()
    code = ("import sys\nfrom lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper\n"
            "assert 'lmshm.platform.cpu.wrappers' not in sys.modules\n"
            "w = DeviceIPCWrapper.Deserialize(sys.stdin.buffer.read())\n"
            "print(type(w).__module__, type(w).__name__, w.segment)")
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=60, check=True)
    assert out.stdout.decode().split() == ["lmshm.platform.cpu.wrappers", "CpuShmIPCWrapper", "lmshm-1-abcdef"]
