"""The device the GPU checks run on: ``cuda:0`` unless ``--gpu-device`` names another.

``nox -s gpu`` runs them on ``cuda:0``; the normal suite runs the very same steps with
``--gpu-device cpu`` (``tests/gpu/steps.py``, ``tests/test_gpu_steps.py``), so on a GPU
only the device differs from what CI has already run.
"""

from __future__ import annotations

import pytest

DEFAULT_DEVICE = "cuda:0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-device",
        default=DEFAULT_DEVICE,
        help=f"the device of tests/gpu (default {DEFAULT_DEVICE}; cpu rehearses them)",
    )


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """The device under test (the option is known only when tests/gpu is named on the
    command line, as the gpu steps do; otherwise ``cuda:0``)."""
    return str(request.config.getoption("--gpu-device", default=DEFAULT_DEVICE))
