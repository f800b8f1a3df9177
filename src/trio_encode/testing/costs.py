"""A cost model for the in-memory engine: what registration and transfers cost on RDMA.

Over TCP on loopback registering CPU memory takes microseconds, so a benchmark there cannot
show what per-request registration costs in production, where registering pins every page and
programs the NIC. This model gives each call a fixed cost plus a cost per byte, and lets
transfers from one engine share one link, so a run on Trio's mock clock can compare paths in
virtual time. It is a model, not a measurement: every figure below says where it comes from,
and every output built on it says "model".
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 1e6


@dataclass(frozen=True)
class CallCost:
    """``fixed`` seconds per call plus ``per_byte`` seconds per byte."""

    fixed: float
    per_byte: float

    def seconds(self, nbytes: int) -> float:
        return self.fixed + self.per_byte * nbytes


@dataclass(frozen=True)
class CostModel:
    """What each engine call costs, in seconds of virtual time."""

    name: str
    register: CallCost
    deregister: CallCost
    transfer: CallCost
    """One transfer on the sender's link; transfers from one engine queue for it."""
    sources: tuple[str, ...]
    """Where the figures come from."""


RDMA = CostModel(
    name="rdma",
    # 500 GB of pre-allocated host DRAM registered in 49.2 s sequentially (0.098 ms/MB) and
    # deregistered in 11.75 s (0.024 ms/MB): Mooncake pull request 855 (kvcache-ai/Mooncake),
    # the lowest public per-byte figure found, so the model favours per-request registration.
    # The fixed part (20 us) is one ioctl round trip into the verbs driver, an assumption.
    register=CallCost(fixed=20e-6, per_byte=0.098e-3 / MB),
    deregister=CallCost(fixed=10e-6, per_byte=0.024e-3 / MB),
    # 25 GB/s on one link: the low end of the 25-40 GB/s that 200-400 Gb/s NICs reach with
    # Mooncake (42 GB/s on one 400 Gb/s NIC, kvcache-ai/Mooncake issue tracker #813); 5 us to post
    # and complete a work request, an assumption.
    transfer=CallCost(fixed=5e-6, per_byte=1 / (25e9)),
    sources=(
        "register/deregister: kvcache-ai/Mooncake pull request 855 (500 GB host DRAM: "
        "register 49.2 s, deregister 11.75 s, sequential); AWS EFA host buffers cost more "
        "(~600 ms for 391 MB, kvcache-ai/Mooncake pull request 3210)",
        "transfer: 25 GB/s per link (42 GB/s measured on one 400 Gb/s NIC, "
        "kvcache-ai/Mooncake issue tracker #813)",
    ),
)
"""Host memory over an RDMA NIC, from public measurements (see ``sources``)."""

MODELS = {RDMA.name: RDMA}
