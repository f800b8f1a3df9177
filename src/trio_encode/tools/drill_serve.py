"""``trio-encode drill-serve``: the server composed from the product's parts with a drill's own.

The drill's parts (:class:`~trio_encode.testing.faults.DrillSettings`): a transfer engine that
fails a seeded fraction of calls with Mooncake's own codes, and a model whose embeddings name
the images they came from, so a receiver can tell its own bytes from another request's. The
soak runs its server this way; ``trio-encode serve`` knows nothing of either. Never for
production.
"""

from __future__ import annotations

from trio_encode.server.serve import listening, model_loader, run_listening, start_engine
from trio_encode.service import ShutdownReport
from trio_encode.settings import ServerSettings
from trio_encode.testing.faults import DrillSettings


async def run_drill_server(settings: ServerSettings, drill: DrillSettings) -> ShutdownReport:
    """``trio-encode serve``'s server, its engine and model wrapped by ``drill``."""
    with listening(settings) as sockets:
        engine = drill.wrap(await start_engine(settings))
        load = model_loader(settings)
        return await run_listening(settings, sockets, engine, lambda: drill.wrap_model(load()))
