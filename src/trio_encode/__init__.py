"""trio_encode: an encode server for disaggregated multimodal serving.

Each request lives in a :class:`~trio_encode.scope.RequestScope` that registers its embedding
with the transfer engine once, keeps every sibling transfer inside its own nursery, and
deregisters before it drops the embedding.
"""

__version__ = "0.1.0"
