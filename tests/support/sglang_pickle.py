"""SGLang 0.5.23's rule for loading a completion message, for tests that cannot import SGLang.

SGLang loads the message with ``safe_pickle_loads``: an unpickler whose ``find_class`` returns
a global only when its exact ``(module, name)`` is on an allow-list, and raises otherwise. The
unpickler here follows that rule with the entries a message may use (SGLang's own, copied as
data), and maps SGLang's classes to stand-ins written from SGLang's field list
(``nox -s sglang`` loads the same bytes with SGLang itself).
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import Any

import torch

ALLOWED = frozenset(
    {
        ("builtins", "int"),
        ("builtins", "list"),
        ("builtins", "str"),
        ("builtins", "dict"),
        ("torch", "float32"),
        ("torch", "bfloat16"),
        ("torch", "float16"),
        ("torch", "LongTensor"),
        ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
        ("sglang.srt.managers.schedule_batch", "Modality"),
        ("sglang.srt.multimodal.modality", "Modality"),
    }
)
"""The entries of SGLang's ``SafeUnpickler.ALLOWED_GLOBALS`` that a message could need."""


class Modality(enum.Enum):
    """SGLang's ``Modality``: members numbered by ``auto()`` in this order."""

    IMAGE = enum.auto()
    VIDEO = enum.auto()
    AUDIO = enum.auto()


class EmbeddingData:
    """SGLang's ``EmbeddingData``: what its ``__init__`` sets, in its order."""

    def __init__(
        self,
        req_id: str,
        num_parts: int,
        part_idx: int,
        grid_dim: Any,
        modality: Modality,
        embedding: torch.Tensor | None = None,
        embedding_shape: list[int] | None = None,
        error_msg: str | None = None,
        error_code: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.req_id = req_id
        self.num_parts = num_parts
        self.part_idx = part_idx
        self.grid_dim = grid_dim
        self.modality = modality
        self.embedding = embedding
        self.send_time = None
        self.dtype = embedding.dtype if embedding is not None else None
        if embedding_shape is not None:
            self.shape = embedding_shape
        else:
            self.shape = list(embedding.shape) if embedding is not None else None
        self._mr_ptr: int | None = None
        self.error_msg = error_msg
        self.error_code = int(error_code) if error_code is not None else None
        for key, value in kwargs.items():  # extra metadata, e.g. a video's timestamps
            setattr(self, key, value)

    def copy_without_embedding(self) -> EmbeddingData:
        """What SGLang's encoder pickles: a new object, then every public attribute copied."""
        new = EmbeddingData(
            self.req_id,
            self.num_parts,
            self.part_idx,
            self.grid_dim,
            self.modality,
            None,
            self.shape,
            self.error_msg,
            self.error_code,
        )
        for key, value in self.__dict__.items():
            if not key.startswith("_") and key != "embedding":
                setattr(new, key, value)
        return new


STAND_INS: dict[tuple[str, str], Any] = {
    ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"): EmbeddingData,
    ("sglang.srt.managers.schedule_batch", "Modality"): Modality,
    ("sglang.srt.multimodal.modality", "Modality"): Modality,
}


class AllowListUnpickler(pickle.Unpickler):
    """SGLang's rule: an exact ``(module, name)`` on the list, or an error."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name})")
        return STAND_INS.get((module, name)) or super().find_class(module, name)


def safe_loads(data: bytes) -> Any:
    return AllowListUnpickler(io.BytesIO(data)).load()
