"""The one error type of lmshm, and its codes: the same on every endpoint.

``ServerError`` carries an ``ErrorCode`` and a message. The registry, the data plane and the
regions raise it (through the subclasses below) inside the server; ``lmshm.Server``'s methods
raise it to an application that embeds the server; ``MPClient`` raises it when a ZeroMQ reply
carries an error; the HTTP and gRPC endpoints translate its code to a status
(``lmshm.endpoints.triton``). A code never changes meaning: a new failure takes a new number.

The codes themselves are the wire's (``lmshm.wire.protocol.ErrorCode``), imported here; nothing
here imports anything heavy, so ``lmshm status`` stays light.
"""

from __future__ import annotations

from lmshm.wire.protocol import ErrorCode  # the codes are the wire's (protocol.py); re-exported here


class LmshmError(Exception):
    """Base of every error lmshm raises on purpose."""


class ServerError(LmshmError):
    """A refused or failed request: ``code`` (an ``ErrorCode``) and ``message``."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, code: "int | str", message: "str | None" = None) -> None:
        if message is None:  # a subclass raised with just a message: its own code
            code, message = self.code, str(code)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = code  # type: ignore[assignment] - a newer server's code: keep the number
        self.message = message
        name = self.code.name if isinstance(self.code, ErrorCode) else str(code)
        super().__init__(f"{name}: {message}")


class InvalidArgument(ServerError):
    code = ErrorCode.INVALID_ARG


class AlreadyExists(ServerError):
    code = ErrorCode.ALREADY_EXISTS


class NotFound(ServerError):
    code = ErrorCode.NOT_FOUND


class Unavailable(ServerError):
    code = ErrorCode.UNAVAILABLE


class Unsupported(ServerError):
    code = ErrorCode.UNSUPPORTED


class PermissionDenied(ServerError):
    code = ErrorCode.PERMISSION_DENIED


class InternalServerError(ServerError):
    code = ErrorCode.INTERNAL


class LayoutMismatch(ServerError):
    """The registration's layout cannot be moved block by block, or differs from the stored chunk's."""

    code = ErrorCode.LAYOUT


class DataLoss(ServerError):
    """A copy failed in the server; nothing of it was made visible (RETRIEVE: recompute the blocks)."""

    code = ErrorCode.DATA_LOSS


_BY_CODE: dict[int, type[ServerError]] = {
    cls.code: cls for cls in (InvalidArgument, AlreadyExists, NotFound, Unavailable, Unsupported,
                              PermissionDenied, InternalServerError, LayoutMismatch, DataLoss)
}


def error(code: int, message: str) -> ServerError:
    """The ``ServerError`` subclass for ``code`` (plain ``ServerError`` for an unknown code)."""
    return _BY_CODE.get(code, ServerError)(code, message)
