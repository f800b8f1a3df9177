"""PNG plots of the transfer rows: served/peer and served/raw against embedding size, one
line per TP, solid with the arena and dashed without (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trio_encode.tools.bench.results import BenchResult, TransferRow


def write_plots(result: BenchResult, directory: Path) -> list[Path]:
    """Write the plots into ``directory``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    charts: list[tuple[str, str, Callable[[TransferRow], float | None], float]] = [
        ("send_vs_peer.png", "served / asyncio peer", lambda r: r.served_over_peer, 1.2),
        ("send_vs_raw.png", "served / raw engine", lambda r: r.served_over_raw, 0.9),
    ]
    for name, label, ratio, target in charts:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        tps = sorted({row.tp for row in result.transfers})
        for index, tp in enumerate(tps):
            for arena, style in ((True, "-"), (False, "--")):
                rows = sorted(
                    (r for r in result.transfers if r.tp == tp and r.arena == arena),
                    key=lambda r: r.nbytes,
                )
                points = [(r.nbytes / 1e6, value) for r in rows if (value := ratio(r)) is not None]
                if points:
                    axes.plot(
                        [x for x, _ in points],
                        [y for _, y in points],
                        style,
                        marker="o",
                        color=f"C{index}",
                        label=f"TP={tp}, arena {'on' if arena else 'off'}",
                    )
        axes.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        axes.set_xscale("log")
        axes.set_xlabel("embedding size (MB)")
        axes.set_ylabel(label)
        axes.set_title(f"/send, {label} (measured, {result.rounds} rounds)")
        axes.legend(fontsize=7, ncol=2)
        figure.tight_layout()
        path = directory / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
