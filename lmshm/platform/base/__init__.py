"""The wrapper contract and the process-wide machinery every wrapper kind shares."""

from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper, dtype_from_name, dtype_name
from lmshm.platform.base.mappings import MAPPINGS, Lease, MappingTable

__all__ = [
    "DeviceIPCWrapper",
    "Lease",
    "MAPPINGS",
    "MappingTable",
    "dtype_from_name",
    "dtype_name",
]
