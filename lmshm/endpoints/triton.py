"""What the HTTP and gRPC endpoints share: Triton's status codes, the restricted API, rows, and
each endpoint's fd budget (``connection_budget``).

Both endpoints are thin: they decode a request, call one ``lmshm.Server`` method, and encode
the answer or the ``ServerError``. The code -> status tables follow Triton's own mapping of its
error codes (``INVALID_ARG`` and ``ALREADY_EXISTS`` are HTTP 400, ``NOT_FOUND`` 404,
``UNAVAILABLE`` 503, ``UNSUPPORTED`` 501, ``INTERNAL`` 500), extended to lmshm's codes that
Triton lacks (``PERMISSION_DENIED``, ``LAYOUT``, ``DATA_LOSS``).
"""

from __future__ import annotations

import hmac
import logging
import resource
from typing import Any, Callable, Optional

import grpc

from lmshm.core.errors import ErrorCode
from lmshm.settings import parse_restriction

logger = logging.getLogger("lmshm.endpoints")

HTTP_STATUS = {
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.INTERNAL: 500,
    ErrorCode.LAYOUT: 400,
    ErrorCode.DATA_LOSS: 500,
}

GRPC_STATUS = {
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.LAYOUT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
}


def http_status(code: Any) -> int:
    return HTTP_STATUS.get(code, 500)


def grpc_status(code: Any) -> grpc.StatusCode:
    return GRPC_STATUS.get(code, grpc.StatusCode.UNKNOWN)


#: Triton's gRPC endpoint looks for the restricted key under this metadata prefix.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class Restriction:
    """``--http-restricted-api`` / ``--grpc-restricted-api``: a header the shared-memory
    operations require (gRPC: metadata ``triton-grpc-protocol-<header>``, as Triton names it).
    ``problem(get)`` is None when the request may go on; the value is compared in constant time."""

    def __init__(self, setting: str, *, prefix: str = "", word: str = "API") -> None:
        header, self._value = parse_restriction(setting) if setting else ("", "")
        self.header = prefix + header if header else ""
        self._word = word

    def problem(self, get: Callable[[str], Optional[str]]) -> Optional[str]:
        if not self.header:
            return None
        got = get(self.header)
        if isinstance(got, str) and hmac.compare_digest(got.encode("utf-8", "surrogatepass"), self._value.encode()):
            return None
        return f"This {self._word} is restricted, expecting header '{self.header}'"


#: The most connections (so fds) one endpoint may hold, as a fraction of RLIMIT_NOFILE: the two
#: endpoints together never take more than a quarter of the process's fds, whatever floods them,
#: so the ZeroMQ listener, the fd channel and the mappings keep theirs.
FD_BUDGET_DIVISOR = 8
MIN_CONNECTIONS = 16


def connection_budget(configured: int, flag: str, fds_per_connection: int = 1) -> int:
    """``configured`` connections, or fewer if that would take more than 1/``FD_BUDGET_DIVISOR``
    of the open-file limit (logged, naming ``flag``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    budget = max(MIN_CONNECTIONS, soft // FD_BUDGET_DIVISOR // fds_per_connection)
    if configured > budget:
        logger.warning("lmshm: %s %d would let one endpoint take more than 1/%d of the open-file limit (%d); "
                       "using %d", flag, configured, FD_BUDGET_DIVISOR, soft, budget)
        return budget
    return configured


def system_row(reg: Any) -> dict[str, Any]:
    r = reg.region
    return {"name": reg.instance_id, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}


def cuda_row(reg: Any) -> dict[str, Any]:
    r = reg.region
    return {"name": reg.instance_id, "device_id": r.device_id, "byte_size": r.byte_size}


ROWS = {"system": system_row, "cuda": cuda_row}
