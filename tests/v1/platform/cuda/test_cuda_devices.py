"""GPU identity: UUIDs travel, ordinals are resolved locally (pure logic, no GPU)."""

from __future__ import annotations

import pytest

from lmshm.platform.cuda.devices import (
    UnknownDeviceError,
    format_uuid,
    is_gpu_uuid,
    normalize_uuid,
    resolve_device_uuid,
)

A = "GPU-00000000-1111-2222-3333-444444444444"
B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def test_raw_uuid_bytes_are_spelled_like_nvidia_smi():
    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@pytest.mark.parametrize("spelling", [
    B, B.upper(), B[4:], "MIG-" + B[4:], B[4:].replace("-", ""), "  " + B + " ",
])
def test_the_usual_spellings_of_one_uuid_normalise_to_one(spelling):
    assert normalize_uuid(spelling) == B


@pytest.mark.parametrize("bad", ["", "GPU-", "GPU-1234", "cuda:0", "GPU-" + "g" * 32, 7])
def test_anything_else_is_not_a_uuid(bad):
    assert not is_gpu_uuid(bad)
    with pytest.raises(ValueError):
        normalize_uuid(bad)


def test_a_uuid_resolves_to_its_position_among_the_visible_devices():
    assert resolve_device_uuid(B, [A, B]) == 1
    assert resolve_device_uuid(B.upper(), [B[4:].replace("-", "")]) == 0


def test_an_unknown_uuid_names_itself_and_lists_what_is_visible():
    with pytest.raises(UnknownDeviceError) as info:
        resolve_device_uuid(B, [A])
    msg = str(info.value)
    assert B in msg and f"cuda:0={A}" in msg and "CUDA_VISIBLE_DEVICES" in msg


def test_a_process_that_sees_no_gpu_says_so():
    with pytest.raises(UnknownDeviceError, match="devices it sees: none"):
        resolve_device_uuid(A, [])
