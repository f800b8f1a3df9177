"""A stub of torchvision for ``nox -s sglang`` (see tests/sglang/drive.py).

torchvision's CPU build for this torch cannot be installed here, and SGLang imports it only for
model preprocessors the encoder receiver never runs. Every name is a placeholder that accepts
any call or attribute; using one for real would produce nothing.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.28.0"


class Placeholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Placeholder:
        return Placeholder()

    def __getattr__(self, name: str) -> Placeholder:
        return Placeholder()


def __getattr__(name: str) -> Placeholder:
    return Placeholder()
