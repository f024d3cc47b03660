"""STAND-IN for ``torchvision.transforms`` (see the package's docstring)."""

from torchvision import _Placeholder, __getattr__  # noqa: F401
from torchvision.transforms.functional import InterpolationMode  # noqa: F401
