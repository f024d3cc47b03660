"""STAND-IN for ``torchvision.transforms`` (see the package's docstring)."""

from torchvision import __getattr__, _Placeholder  # noqa: F401 (the names SGLang imports from here)
from torchvision.transforms.functional import InterpolationMode  # noqa: F401 (the names SGLang imports from here)
