"""The RDMA devices of this host, so that ``--engine-protocol rdma`` is refused at start where
there are none: Mooncake itself starts without one and serves (every transfer then fails), so
the first sign of a misconfigured host would otherwise be failed sends minutes later.

The kernel lists every RDMA device (InfiniBand, RoCE, iWARP) under ``/sys/class/infiniband``.
"""

from __future__ import annotations

from pathlib import Path

SYSFS = Path("/sys/class/infiniband")
"""Where the kernel lists this host's RDMA devices, one entry each."""


def rdma_devices(root: Path = SYSFS) -> list[str]:
    """The names of this host's RDMA devices (``mlx5_0``...), sorted; none without any."""
    try:
        return sorted(entry.name for entry in root.iterdir())
    except OSError:  # no such directory: no RDMA stack, no device
        return []


def check_rdma(protocol: str, device: str, root: Path = SYSFS) -> None:
    """Refuse the engine's settings if they ask for RDMA on a host without the devices: a
    :class:`ValueError` naming the flag, before any engine starts. ``device`` is Mooncake's
    comma-separated list of device names (``mlx5_0,mlx5_1``; a JSON topology is not
    checked); each name must be one of this host's."""
    if protocol != "rdma":
        return
    found = rdma_devices(root)
    if not found:
        raise ValueError(
            f"--engine-protocol rdma: this host has no RDMA device (nothing under {root}); "
            "use --engine-protocol tcp, or install the NIC's RDMA driver"
        )
    if device.lstrip().startswith(("{", "[")):
        return
    names = [name.strip().partition(":")[0] for name in device.split(",") if name.strip()]
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(
            f"--engine-device {device}: no RDMA device {', '.join(missing)} on this host "
            f"(it has {', '.join(found)})"
        )
