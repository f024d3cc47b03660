"""STAND-IN for torchvision, for the SGLang tests only (never on a user's path).

PyPI has CUDA builds of torchvision only, which fail to load beside the CPU torch of
.venv-sglang. One SGLang config module imports ``torchvision.transforms`` at import time for a
multimodal model that the HiCache tests never build. The driver puts this directory on
``sys.path`` after transformers has decided torchvision is absent, so nothing uses it for real:
any attribute is an inert placeholder that fails if called.
"""


class _Placeholder:
    def __init__(self, *a, **k):
        raise RuntimeError("torchvision stand-in: not available in the SGLang HiCache tests")

    def __class_getitem__(cls, item):
        return cls


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder
