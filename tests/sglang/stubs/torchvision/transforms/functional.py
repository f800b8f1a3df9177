"""Part of the torchvision stub (see ``torchvision/__init__.py``)."""

from torchvision import Placeholder


def __getattr__(name: str) -> Placeholder:
    return Placeholder()
