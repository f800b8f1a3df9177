"""A deliberately naive request scope, kept to prove the tests catch what they guard against.

It is SGLang's encode server before PR #32071: every ``/send`` registers the embedding,
transfers, deregisters, and sets the embedding to ``None``, each sibling on its own.
"""

from __future__ import annotations

from trio_encode.engine import TransferEngine, Write
from trio_encode.request_types import EmbeddingMemory, Receiver


class EmbeddingGone(RuntimeError):
    """The naive scope's sibling found the embedding already dropped."""


class NaiveScope:
    def __init__(self, engine: TransferEngine, embedding: EmbeddingMemory) -> None:
        self._engine = engine
        self.embedding: EmbeddingMemory | None = embedding

    async def send(self, receiver: Receiver) -> None:
        embedding = self.embedding
        if embedding is None:
            raise EmbeddingGone("embedding is None: a sibling already sent and dropped it")
        await self._engine.register(embedding.address, embedding.nbytes)
        try:
            await self._engine.transfer(
                Write(
                    receiver.session_id,
                    [(embedding.address, embedding.nbytes)],
                    receiver.buffer_address,
                )
            )
        finally:
            await self._engine.deregister(embedding.address)
        self.embedding = None
