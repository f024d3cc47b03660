"""Fixtures of the CUDA wrapper tests.

``fake_driver`` swaps lmshm's driver gateway for ``FakeCudaDriver`` (a fake, see
fake_driver.py) for CPU-only tests of refcount, selection and error-wording logic.
``as_consumer`` makes this process look like another one to the wrappers (the producer id
changes), since a real CUDA IPC handle can never be opened by the process that exported it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_driver import FakeCudaDriver

from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.cuda import _common, driver


def cuda_mapping_keys() -> list:
    return [k for k in MAPPINGS.keys() if isinstance(k, tuple) and str(k[0]).startswith("cuda")]


@pytest.fixture
def fake_driver():
    fake = FakeCudaDriver()
    old = driver.install_driver(fake)
    try:
        yield fake
    finally:
        driver.install_driver(old)
    assert not cuda_mapping_keys(), f"test left CUDA mappings open: {cuda_mapping_keys()}"


@pytest.fixture
def as_consumer(monkeypatch):
    """Call to make later wrapper operations in this process act as a different process."""

    def switch() -> None:
        monkeypatch.setattr(_common, "_NONCE", "0123456789ab" if _common._NONCE != "0123456789ab" else "ba9876543210")

    return switch
