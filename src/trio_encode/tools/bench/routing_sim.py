"""Cache hit rate against fleet size: content-affinity vs random routing, with and without a
cluster-wide store, under Zipf-distributed image popularity.

A request stream of single images, drawn from a catalogue with Zipf popularity, is routed over
``n`` encoders, each with an LRU cache of ``cache_entries`` embeddings:

- ``random``: each request picks an encoder at random (what peers do today);
- ``affinity``: the encoder ranked first for the image by :mod:`trio_encode.client.ranking`
  (the fleet client's own ranking code);
- ``+store``: a shared LRU store of ``store_entries_per_encoder * n`` entries behind the local
  caches, as Mooncake Store is when every encoder lends it a segment.

A hit is a request served without a forward. In-flight de-duplication and failures are not
modelled; the stream is sequential. Run ``python -m trio_encode.tools.bench.routing_sim`` (or
``nox -s simulate``) to print the table and draw the plot (``matplotlib`` needed for the plot).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trio_encode.client.ranking import content_digest, rank

POLICIES = ("random", "affinity", "random+store", "affinity+store")


@dataclass(frozen=True)
class SimConfig:
    images: int = 20_000
    """Distinct images in the catalogue."""
    requests: int = 100_000
    zipf: float = 0.9
    """Popularity exponent: image ``k`` (1-based) is asked for in proportion to ``k ** -zipf``."""
    cache_entries: int = 500
    """Embeddings one encoder's local cache holds."""
    store_entries_per_encoder: int = 2_000
    """Embeddings each encoder's store segment holds."""
    fleet_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 100)
    seed: int = 0


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def hit(self, key: int) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def add(self, key: int) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


def request_stream(config: SimConfig) -> np.ndarray:
    """The images asked for, in order."""
    rng = np.random.default_rng(config.seed)
    weights = np.arange(1, config.images + 1, dtype=np.float64) ** -config.zipf
    return rng.choice(config.images, size=config.requests, p=weights / weights.sum())


def affinity_encoders(images: int, n: int) -> np.ndarray:
    """For each image, the encoder (0..n-1) the fleet client's ranking puts first."""
    names = [f"http://encoder-{e}:8000" for e in range(n)]
    index = {name: e for e, name in enumerate(names)}
    return np.array(
        [index[rank(names, content_digest([f"image-{i}"]))[0]] for i in range(images)],
        dtype=np.int64,
    )


@dataclass(frozen=True)
class Rates:
    hits: float
    """Requests served without a forward."""
    local: float
    """Requests served from the local cache of the encoder they went to."""


def hit_rate(
    stream: np.ndarray, encoders: np.ndarray, n: int, config: SimConfig, store: bool
) -> Rates:
    """What share of ``stream`` is served without a forward when request ``r`` goes to
    ``encoders[r]``."""
    caches = [_LRU(config.cache_entries) for _ in range(n)]
    shared = _LRU(config.store_entries_per_encoder * n) if store else None
    hits = local = 0
    for image, encoder in zip(stream.tolist(), encoders.tolist(), strict=True):
        cache = caches[encoder]
        if cache.hit(image):
            hits += 1
            local += 1
            continue
        if shared is not None and shared.hit(image):
            hits += 1
        elif shared is not None:
            shared.add(image)
        cache.add(image)
    return Rates(hits / len(stream), local / len(stream))


def simulate(config: SimConfig) -> dict[str, list[Rates]]:
    """Rates per policy, one per fleet size in ``config.fleet_sizes``."""
    stream = request_stream(config)
    rng = np.random.default_rng(config.seed + 1)
    results: dict[str, list[Rates]] = {policy: [] for policy in POLICIES}
    for n in config.fleet_sizes:
        randomly = rng.integers(0, n, size=len(stream))
        by_content = affinity_encoders(config.images, n)[stream]
        for policy in POLICIES:
            routed = by_content if policy.startswith("affinity") else randomly
            results[policy].append(hit_rate(stream, routed, n, config, policy.endswith("store")))
    return results


def table(config: SimConfig, results: dict[str, list[Rates]]) -> str:
    """Hit rates, and in brackets the share served from the local cache."""
    lines = [f"{'encoders':>8} " + " ".join(f"{p:>18}" for p in POLICIES)]
    for column, n in enumerate(config.fleet_sizes):
        cells = [results[p][column] for p in POLICIES]
        lines.append(f"{n:>8} " + " ".join(f"{c.hits:>10.3f} ({c.local:.3f})" for c in cells))
    return "\n".join(lines)


def plot(config: SimConfig, results: dict[str, list[Rates]], path: Path) -> None:
    """Two panels: requests served without a forward, and served from the local cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = {"random": "C1--", "affinity": "C0-", "random+store": "C1:", "affinity+store": "C0-."}
    for axes, what, title in (
        (panels[0], "hits", "served without a forward"),
        (panels[1], "local", "served from the encoder's own cache"),
    ):
        for policy in POLICIES:
            values = [getattr(rates, what) for rates in results[policy]]
            axes.plot(config.fleet_sizes, values, styles[policy], marker="o", label=policy)
        axes.set_xscale("log")
        axes.set_xticks(config.fleet_sizes, [str(n) for n in config.fleet_sizes])
        axes.set_xlabel("encoders in the fleet")
        axes.set_title(title)
        axes.set_ylim(0, 1)
        axes.grid(True, alpha=0.3)
    panels[0].set_ylabel("share of requests")
    panels[0].legend()
    figure.suptitle(
        f"Zipf({config.zipf}) over {config.images:,} images, {config.requests:,} requests; "
        f"{config.cache_entries} embeddings cached per encoder, "
        f"{config.store_entries_per_encoder} stored per encoder",
        fontsize=9,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--plot", type=Path, help="write the plot to this PNG")
    parser.add_argument("--requests", type=int, default=SimConfig.requests)
    parser.add_argument("--zipf", type=float, default=SimConfig.zipf)
    args = parser.parse_args(argv)
    config = SimConfig(requests=args.requests, zipf=args.zipf)
    results = simulate(config)
    print(table(config, results))
    if args.plot is not None:
        plot(config, results, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
