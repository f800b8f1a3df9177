"""A model's fingerprint: what must match for two encoders to share cached embeddings.

An embedding is a function of the image's bytes and of everything that shapes the forward:
the kind of model, its configuration, its dtype, its weights (and, because kernels differ, the
torch release). The fingerprint digests all of these, and only these: not a file path or a
host name, so the same model on every host of a cluster gets the same fingerprint, and a model
that differs in any of them never does.

Some rows also depend on settings outside the model: a video's rows on how its frames are
sampled and resized. Those settings are an item's recipe (:func:`recipe_digest`), part of its
key beside the fingerprint, so servers (or runs) that sample otherwise never share an entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch


def weights_digest(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """BLAKE2b of every parameter and buffer (of a module, or named tensors): name, dtype,
    shape and bytes, in name order.

    Reads every weight (tens of ms for the built-in model, about a second per GB): call it
    once, at load.
    """
    digest = hashlib.blake2b(digest_size=32)
    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    for name, tensor in sorted(state.items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def model_fingerprint(kind: str, config: Mapping[str, object], dtype: str, weights: str) -> str:
    """The fingerprint of a model: ``kind`` (e.g. ``builtin-vit``), its ``config`` (anything
    JSON can write, keys sorted), ``dtype`` and :func:`weights_digest`."""
    facts = {
        "kind": kind,
        "config": config,
        "dtype": dtype,
        "weights": weights,
        "torch": torch.__version__,
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def recipe_digest(settings: Mapping[str, object]) -> str:
    """The recipe of a modality's items: a digest of the ``settings`` (anything JSON can
    write, keys sorted) that turn an item's bytes into the model's input beyond the model."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
