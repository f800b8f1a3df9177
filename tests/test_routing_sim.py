"""The routing simulation, shrunk: its conclusions hold on a small stream too."""

from __future__ import annotations

from pathlib import Path

from trio_encode.tools.bench.routing_sim import SimConfig, affinity_encoders, simulate, table

SMALL = SimConfig(
    images=2_000,
    requests=10_000,
    cache_entries=100,
    store_entries_per_encoder=200,
    fleet_sizes=(1, 4, 16),
)


def test_affinity_grows_the_hit_rate_with_the_fleet_random_does_not() -> None:
    results = simulate(SMALL)
    affinity = [rates.hits for rates in results["affinity"]]
    randomly = [rates.hits for rates in results["random"]]
    assert affinity[0] == randomly[0]  # one encoder: routing cannot matter
    assert affinity[0] < affinity[1] < affinity[2]
    assert randomly[2] <= randomly[0] + 0.01
    # The store recovers what random routing loses, but from the store, not locally.
    assert results["random+store"][2].hits > randomly[2] + 0.2
    assert results["random+store"][2].local == results["random"][2].local
    assert "affinity+store" in table(SMALL, results)


def test_the_simulation_routes_with_the_clients_own_ranking() -> None:
    from trio_encode.client.ranking import content_digest, rank

    names = [f"http://encoder-{e}:8000" for e in range(5)]
    chosen = affinity_encoders(50, 5)
    for image in range(50):
        assert names[chosen[image]] == rank(names, content_digest([f"image-{image}"]))[0]


def test_the_plot_is_drawn(tmp_path: Path) -> None:
    from trio_encode.tools.bench.routing_sim import plot

    tiny = SimConfig(images=200, requests=1_000, cache_entries=10, fleet_sizes=(1, 2))
    path = tmp_path / "plot.png"
    plot(tiny, simulate(tiny), path)
    assert path.read_bytes().startswith(b"\x89PNG")
