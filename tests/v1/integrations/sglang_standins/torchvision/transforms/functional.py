"""STAND-IN for ``torchvision.transforms.functional`` (see the package's docstring)."""

from torchvision import __getattr__  # noqa: F401 (any name SGLang imports from here)


class InterpolationMode:
    NEAREST = BILINEAR = BICUBIC = LANCZOS = BOX = HAMMING = NEAREST_EXACT = "stand-in"
