"""The protobuf messages of Triton's shared-memory gRPC API, built from a table at import.

Field names, numbers and types are those of ``inference.GRPCInferenceService`` in Triton's
``grpc_service.proto`` (the facts a stock ``tritonclient`` encodes against; the test suite
compares every field with the client's own descriptors). The file descriptor is built here,
in a private ``DescriptorPool``, so there is no generated code and no protoc step, and the
messages never clash with a ``tritonclient`` loaded in the same process.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = "inference.GRPCInferenceService"

_T = descriptor_pb2.FieldDescriptorProto
_TYPES = {"bool": _T.TYPE_BOOL, "string": _T.TYPE_STRING, "uint64": _T.TYPE_UINT64, "int64": _T.TYPE_INT64,
          "bytes": _T.TYPE_BYTES}

_SYSTEM_STATUS = (("name", 1, "string"), ("key", 2, "string"), ("offset", 3, "uint64"), ("byte_size", 4, "uint64"))
_CUDA_STATUS = (("name", 1, "string"), ("device_id", 2, "uint64"), ("byte_size", 3, "uint64"))

#: message -> fields (name, number, type); "map:RegionStatus" is map<string, RegionStatus>.
MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "ServerLiveRequest": (),
    "ServerLiveResponse": (("live", 1, "bool"),),
    "ServerReadyRequest": (),
    "ServerReadyResponse": (("ready", 1, "bool"),),
    "ServerMetadataRequest": (),
    "ServerMetadataResponse": (("name", 1, "string"), ("version", 2, "string"), ("extensions", 3, "repeated string")),
    "SystemSharedMemoryStatusRequest": (("name", 1, "string"),),
    "SystemSharedMemoryStatusResponse": (("regions", 1, "map:RegionStatus"),),
    "SystemSharedMemoryRegisterRequest": _SYSTEM_STATUS,
    "SystemSharedMemoryRegisterResponse": (),
    "SystemSharedMemoryUnregisterRequest": (("name", 1, "string"),),
    "SystemSharedMemoryUnregisterResponse": (),
    "CudaSharedMemoryStatusRequest": (("name", 1, "string"),),
    "CudaSharedMemoryStatusResponse": (("regions", 1, "map:RegionStatus"),),
    "CudaSharedMemoryRegisterRequest": (("name", 1, "string"), ("raw_handle", 2, "bytes"), ("device_id", 3, "int64"),
                                        ("byte_size", 4, "uint64")),
    "CudaSharedMemoryRegisterResponse": (),
    "CudaSharedMemoryUnregisterRequest": (("name", 1, "string"),),
    "CudaSharedMemoryUnregisterResponse": (),
}
#: The nested RegionStatus of each status response.
NESTED = {"SystemSharedMemoryStatusResponse": _SYSTEM_STATUS, "CudaSharedMemoryStatusResponse": _CUDA_STATUS}
#: RPC -> (request, response) message names.
RPCS = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "SystemSharedMemoryStatus": ("SystemSharedMemoryStatusRequest", "SystemSharedMemoryStatusResponse"),
    "SystemSharedMemoryRegister": ("SystemSharedMemoryRegisterRequest", "SystemSharedMemoryRegisterResponse"),
    "SystemSharedMemoryUnregister": ("SystemSharedMemoryUnregisterRequest", "SystemSharedMemoryUnregisterResponse"),
    "CudaSharedMemoryStatus": ("CudaSharedMemoryStatusRequest", "CudaSharedMemoryStatusResponse"),
    "CudaSharedMemoryRegister": ("CudaSharedMemoryRegisterRequest", "CudaSharedMemoryRegisterResponse"),
    "CudaSharedMemoryUnregister": ("CudaSharedMemoryUnregisterRequest", "CudaSharedMemoryUnregisterResponse"),
}


def _add_field(msg: Any, name: str, number: int, kind: str, scope: str) -> None:
    f = msg.field.add(name=name, number=number)
    if kind.startswith("map:"):
        entry = msg.nested_type.add(name="RegionsEntry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=_T.TYPE_STRING, label=_T.LABEL_OPTIONAL)
        entry.field.add(name="value", number=2, type=_T.TYPE_MESSAGE, label=_T.LABEL_OPTIONAL,
                        type_name=f".{scope}.{kind[4:]}")
        f.type, f.label, f.type_name = _T.TYPE_MESSAGE, _T.LABEL_REPEATED, f".{scope}.RegionsEntry"
    elif kind.startswith("repeated "):
        f.type, f.label = _TYPES[kind.split()[1]], _T.LABEL_REPEATED
    else:
        f.type, f.label = _TYPES[kind], _T.LABEL_OPTIONAL


def _build() -> dict[str, Any]:
    file = descriptor_pb2.FileDescriptorProto(name="lmshm/triton_shared_memory.proto", package=PACKAGE,
                                              syntax="proto3")
    for name, fields in MESSAGES.items():
        msg = file.message_type.add(name=name)
        scope = f"{PACKAGE}.{name}"
        if name in NESTED:
            nested = msg.nested_type.add(name="RegionStatus")
            for field in NESTED[name]:
                _add_field(nested, *field, scope=scope)
        for field in fields:
            _add_field(msg, *field, scope=scope)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name in MESSAGES}


CLASSES = _build()


def message(name: str) -> Any:
    return CLASSES[name]
