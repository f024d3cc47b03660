"""Bytes <-> protocol structs: msgpack via msgspec, wrappers under ext code 1.

What travels how:
- protocol structs are msgpack maps tagged by their ``type`` code (see ``protocol.py``);
- ``torch.dtype`` travels as its name (``"float16"``), ``torch.Size`` as a list of ints;
- an IPC wrapper travels as msgpack extension type **1** whose payload is
  ``wrapper.Serialize()`` (a pickle of the wrapper's concrete class and plain-data state).

The one thing that matters here: **decoding never runs code a peer chose.** Ext 1 payloads
go through ``safe_loads``, an unpickler whose ``find_class`` admits only the lmshm wrapper
classes listed in ``lmshm.platform.wrapper_registry`` (nothing from ``builtins``, ``os``, ...;
imported on the first ext-1 payload, never for plain messages), and whose wrappers validate their
state field by field. Any other ext code, a truncated frame or random bytes become a
``CodecError``, which the server answers with ``INVALID_ARG``. Decoding a wrapper maps
nothing; mapping happens later, in the registry.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from lmshm.wire import protocol

#: msgpack extension type code of an lmshm wrapper.
WRAPPER_EXT_CODE = 1


class CodecError(ValueError):
    """A message could not be encoded or decoded; the text says what and why."""


# Nothing here imports torch or the wrapper machinery up front, so that ``lmshm status`` (and
# anything else that only speaks the protocol) stays light. An object cannot be a wrapper, a
# torch.dtype or a torch.Size unless its module was imported already, so the hooks look them
# up lazily (``protocol.WireWrapper``, sys.modules); only an ext-1 payload actually arriving
# imports the unpickler (and torch).


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, protocol.WireWrapper):
        return msgspec.msgpack.Ext(WRAPPER_EXT_CODE, obj.Serialize())
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.dtype):
            from lmshm.platform.base.ipc_wrapper import dtype_name  # lazy: no torch for plain messages

            return dtype_name(obj)
        if isinstance(obj, torch.Size):
            return list(obj)
    raise NotImplementedError(f"lmshm cannot put a {type(obj).__name__} on the wire")


_unpickler: Any = None  # (safe_loads, WrapperDecodeError), imported on the first ext-1 payload


def _ext_hook(code: int, data: memoryview) -> Any:
    global _unpickler
    if code != WRAPPER_EXT_CODE:
        raise CodecError(f"unknown msgpack extension type {code}; lmshm only sends {WRAPPER_EXT_CODE} (wrapper)")
    if _unpickler is None:
        from lmshm.platform.base.ipc_wrapper import WrapperDecodeError, safe_loads  # lazy: the first ext-1 payload

        _unpickler = (safe_loads, WrapperDecodeError)
    safe_loads, decode_error = _unpickler
    try:
        return safe_loads(data)
    except decode_error as exc:
        raise CodecError(f"refused wrapper payload: {exc}") from None


def _is_wrapper_type(type_: Any) -> bool:
    """``protocol.WireWrapper``, or ``DeviceIPCWrapper`` or a subclass named as a field type."""
    if type_ is protocol.WireWrapper:
        return True
    module = sys.modules.get("lmshm.platform.base.ipc_wrapper")
    return module is not None and isinstance(type_, type) and issubclass(type_, module.DeviceIPCWrapper)


def _dec_hook(type_: type, obj: Any) -> Any:
    if _is_wrapper_type(type_):
        if isinstance(obj, type_):
            return obj
        raise CodecError(f"expected an lmshm wrapper (ext type {WRAPPER_EXT_CODE}), got {type(obj).__name__}")
    torch = sys.modules.get("torch")
    if torch is not None and type_ is torch.dtype:
        from lmshm.platform.base.ipc_wrapper import dtype_from_name  # lazy: no torch for plain messages

        try:
            return dtype_from_name(obj)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
    if torch is not None and type_ is torch.Size:
        if isinstance(obj, list) and all(type(v) is int and v >= 0 for v in obj):
            return torch.Size(obj)
        raise CodecError(f"a torch.Size must be a list of non-negative ints, got {obj!r}")
    raise NotImplementedError(f"no decoder for {type_!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


class Decoder:
    """Decodes one body into one of ``types`` (a Union of structs), or raises ``CodecError``."""

    def __init__(self, types: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(types, ext_hook=_ext_hook, dec_hook=_dec_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        try:
            return self._decoder.decode(data)
        except CodecError:  # includes a refused wrapper payload (see _ext_hook)
            raise
        except msgspec.ValidationError as exc:
            raise CodecError(f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise CodecError(f"undecodable message ({len(data)} bytes): {exc}") from None
        except Exception as exc:
            raise CodecError(f"undecodable message: {type(exc).__name__}: {exc}") from None


def encode(msg: Any) -> bytes:
    """Encode a protocol struct (or any plain data) to msgpack bytes."""
    try:
        return _encoder.encode(msg)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise CodecError(f"cannot encode {type(msg).__name__}: {exc}") from None


request_decoder = Decoder(protocol.Request)
reply_decoder = Decoder(protocol.Reply)


def decode_request(data: bytes | memoryview) -> protocol.Request:
    return request_decoder.decode(data)


def decode_reply(data: bytes | memoryview) -> protocol.Reply:
    return reply_decoder.decode(data)
