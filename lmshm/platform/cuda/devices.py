"""GPU identity: UUIDs on the wire, local ordinals in each process.

A CUDA ordinal means nothing to another process: ``CUDA_VISIBLE_DEVICES`` (or a container's
device list) can number the same GPU 0 in the worker and 3 in the server. Wrappers therefore
carry the GPU's UUID, written ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, and the consumer
resolves it against the devices *it* can see.

``resolve_device_uuid`` is the pure part (a list of UUIDs in, an ordinal or a clear error
out); ``visible_device_uuids`` / ``device_uuid`` / ``local_ordinal`` ask torch. UUIDs compare
case-insensitively and without their ``GPU-``/``MIG-`` prefix, since tools disagree on both.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

_HEX32 = re.compile(r"^[0-9a-f]{32}$")


class UnknownDeviceError(LookupError):
    """A wrapper names a GPU this process cannot see."""


def format_uuid(raw: bytes) -> str:
    """16 raw UUID bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    raw = bytes(raw)
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def normalize_uuid(text: str) -> str:
    """The canonical spelling of a GPU UUID given in any of the usual forms.

    Accepts ``GPU-``/``MIG-`` prefixes or none, any case, with or without dashes.
    Raises ValueError for anything that is not 32 hex digits once those are stripped.
    """
    if not isinstance(text, str):
        raise ValueError(f"a GPU UUID must be a string, got {type(text).__name__}")
    body = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if body.startswith(prefix):
            body = body[len(prefix):]
            break
    body = body.replace("-", "")
    if not _HEX32.match(body):
        raise ValueError(f"{text!r} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return format_uuid(bytes.fromhex(body))


def is_gpu_uuid(text: object) -> bool:
    try:
        normalize_uuid(text)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def resolve_device_uuid(uuid: str, visible: Sequence[str]) -> int:
    """The index in ``visible`` of the GPU named ``uuid``.

    ``visible`` is the list of UUIDs this process sees, in ordinal order. An unknown UUID
    raises UnknownDeviceError naming it and listing what is visible.
    """
    want = normalize_uuid(uuid)
    canon = [normalize_uuid(u) for u in visible]
    for ordinal, have in enumerate(canon):
        if have == want:
            return ordinal
    seen = ", ".join(f"cuda:{i}={u}" for i, u in enumerate(canon)) or "none"
    raise UnknownDeviceError(
        f"GPU {want} is not visible to this process (devices it sees: {seen}); the producer "
        "and this process must run on the same host and both see that GPU -- check "
        "CUDA_VISIBLE_DEVICES and the container's device list"
    )


# ---- torch-querying side ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _torch_uuid(ordinal: int) -> str:
    import torch

    props = torch.cuda.get_device_properties(ordinal)
    uuid = props.uuid
    raw = getattr(uuid, "bytes", None)
    if raw is not None:
        return format_uuid(bytes(raw))
    return normalize_uuid(str(uuid))


def device_uuid(ordinal: int) -> str:
    """The UUID of local CUDA device ``ordinal`` (as torch numbers devices)."""
    return _torch_uuid(int(ordinal))


def visible_device_uuids() -> list[str]:
    """UUIDs of every CUDA device this process can see, in ordinal order."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_ordinal(uuid: str) -> int:
    """This process's ordinal for the GPU named ``uuid``."""
    return resolve_device_uuid(uuid, visible_device_uuids())


def ordinal_of(device: object) -> int:
    """A CUDA ordinal from an int, ``"cuda"``/``"cuda:N"``, a torch.device or a GPU UUID."""
    import torch

    if isinstance(device, bool):
        raise TypeError(f"not a CUDA device: {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"CUDA ordinal must be >= 0, got {device}")
        return device
    if isinstance(device, str) and is_gpu_uuid(device):
        return local_ordinal(device)
    dev = torch.device(device)  # type: ignore[arg-type]
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {dev}")
    return torch.cuda.current_device() if dev.index is None else dev.index
