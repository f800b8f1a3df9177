"""An audio clip through an audio model's own audio path: from decoded samples to the rows
and the lengths SGLang's prefill reads. Qwen2-Audio and Qwen2.5-Omni (its thinker).

SGLang's encode server loads a clip at the rate it resolves from the model's configuration
(:func:`sampling_rate`) and hands it to the model's Whisper feature extractor with its
defaults for the family (:data:`FAMILY_EXTRACTOR_KWARGS`): Qwen2-Audio's clips are padded to
the extractor's 30 s window and a longer one is not cut (SGLang's encoder then fails on it:
here it is refused); Qwen2.5-Omni's are padded to the longest clip of the batch and cut at the
extractor's window (300 s in its checkpoints), silently. Its prefill is sent each clip's
count of log-mel frames (the mask's sum, ``audio_feature_lens`` there), from which it counts
the clip's tokens by the encoder's two stride-2 reductions (:func:`audio_tokens`).
:meth:`AudioPath.prepare` calls the same extractor the same way on one clip: a batch of one,
which is SGLang's answer for a clip sent alone or the longest of its batch (a shorter clip's
last frame, the spectrogram's edge, depends on the padding after it there).

The rows come from the model's own modules, run as its transformers forward runs them:
Qwen2-Audio's ``audio_tower`` on the padded features, with the attention mask its forward
builds from the frame counts, then its ``multi_modal_projector``, each clip's rows cut to its
token count (SGLang's own Qwen2-Audio encoder calls the tower without that mask, so its rows
for a clip shorter than the window differ from the model's; these are the model's); the Omni
thinker's ``get_audio_features``, which packs the clips' frames by their mask itself.

Use: :meth:`AudioPath.for_model` once per model (None for a model without this path);
:meth:`AudioPath.prepare` in a decode thread (CPU work, no model); :meth:`AudioPath.features`
in the model's thread (one forward for any number of clips).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trio_encode.encoder.audio import AudioTooLong, DecodedAudio
from trio_encode.encoder.backend import Prepared
from trio_encode.encoder.vlm import VLMVisionModel

log = logging.getLogger(__name__)

DEFAULT_SAMPLING_RATE = 16_000
"""SGLang's rate for a model whose configuration names none."""

FAMILY_EXTRACTOR_KWARGS: dict[str, dict[str, Any]] = {
    "qwen2_audio": {"return_attention_mask": True, "padding": "max_length", "truncation": False},
    "qwen2_5_omni": {"return_attention_mask": True, "padding": True},
}
"""The families with an audio path here, by the checkpoint's ``model_type``, with the keyword
arguments SGLang's encoder calls their feature extractor with by default (the extractor's own
``truncation=True`` where none is given: a clip is cut at its ``n_samples``)."""


def sampling_rate(config: Any) -> int:
    """The rate SGLang's encoder loads a clip at for a model of this configuration: its
    processor configuration's ``audio_sampling_rate`` (the thinker's, for an Omni model),
    else its audio configuration's ``sampling_rate`` or ``sample_rate``, else
    :data:`DEFAULT_SAMPLING_RATE`. (Not the feature extractor's own ``sampling_rate``.)"""
    thinker = _read(config, "thinker_config")
    processor = _read(thinker, "processor_config") or _read(config, "processor_config")
    rate = _read(processor, "audio_sampling_rate")
    if rate:
        return int(rate)
    audio = _read(thinker, "audio_config") or _read(config, "audio_config")
    for name in ("sampling_rate", "sample_rate"):
        rate = _read(audio, name)
        if rate:
            return int(rate)
    return DEFAULT_SAMPLING_RATE


def _read(owner: Any, name: str) -> Any:
    if owner is None:
        return None
    if isinstance(owner, Mapping):
        return owner.get(name)
    return getattr(owner, name, None)


def audio_tokens(frames: int) -> int:
    """Tokens of a clip of ``frames`` log-mel frames, as SGLang's prefill and the model's
    processor count them: the encoder's stride-2 convolution, then its stride-2 pooling."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


@dataclass(frozen=True, eq=False)
class PreparedAudio(Prepared):
    """One clip as the model takes it (``pixels``: its ``(mel bins, frames)`` input
    features, padded as SGLang pads them; ``grid``: ``(audio_feature_lens,)``, the form SGLang's
    encoder sends it in and its prefill counts the clip's tokens from; ``tokens``: its rows).
    No metadata beside the grid: SGLang's receiver reads an audio part's lengths from it."""

    audio_feature_lens: int = 0
    """The clip's log-mel frames before padding (the feature attention mask's sum)."""


class AudioPath:
    """An audio model's audio path: its feature extractor as SGLang's encoder calls it
    (:meth:`prepare`) and its audio encoder and projector (:meth:`features`)."""

    def __init__(
        self,
        vlm: VLMVisionModel,
        model_type: str,
        extractor: Any,
        extractor_kwargs: Mapping[str, Any],
        rate: int,
    ) -> None:
        self.vlm = vlm
        self.model_type = model_type
        self.extractor = extractor
        self.extractor_kwargs = dict(extractor_kwargs)
        self.sampling_rate = rate
        """The rate :func:`~trio_encode.encoder.audio.decode_audio` is to give samples at."""

    @classmethod
    def for_model(cls, vlm: VLMVisionModel, model_dir: Path) -> AudioPath | None:
        """The audio path of the model loaded from ``model_dir``, or None for a family
        without one here or a feature extractor other than Whisper's."""
        config = json.loads((model_dir / "config.json").read_text())
        model_type = str(config.get("model_type"))
        kwargs = FAMILY_EXTRACTOR_KWARGS.get(model_type)
        if kwargs is None:
            return None
        import transformers

        extractor = transformers.AutoFeatureExtractor.from_pretrained(
            str(model_dir), local_files_only=True
        )
        if not isinstance(extractor, transformers.WhisperFeatureExtractor):
            log.warning(
                "%s: its feature extractor (%s) is not Whisper's; no audio",
                model_dir,
                type(extractor).__name__,
            )
            return None
        return cls(vlm, model_type, extractor, kwargs, sampling_rate(config))

    @property
    def recipe(self) -> dict[str, Any]:
        """The settings beyond the model that turn a clip's bytes into its input features
        (part of a clip's key): the rate it is resampled to and how the extractor pads it."""
        return {"sampling_rate": self.sampling_rate, "extractor": self.extractor_kwargs}

    def prepare(self, decoded: DecodedAudio) -> PreparedAudio:
        """The clip's input features as SGLang's encoder computes them, with its frame and
        token counts. CPU work only; safe to run in several threads at once."""
        if decoded.sampling_rate != self.sampling_rate:
            raise ValueError(
                f"the clip is at {decoded.sampling_rate} Hz; this model takes {self.sampling_rate}"
            )
        window = int(self.extractor.n_samples)
        if self.extractor_kwargs.get("truncation") is False and len(decoded.samples) > window:
            raise AudioTooLong(
                f"the audio is {decoded.duration:.1f} seconds; this model's encoder takes at "
                f"most {window / self.sampling_rate:g} seconds a clip (its feature extractor's "
                "n_samples)"
            )
        # Its own rate, named only to quiet its warning: the rate is SGLang's, as checked above.
        out = self.extractor(
            [decoded.samples],
            return_tensors="np",
            sampling_rate=self.extractor.sampling_rate,
            **self.extractor_kwargs,
        )
        features = torch.from_numpy(np.ascontiguousarray(out["input_features"][0]))
        frames = int(out["attention_mask"][0].sum())
        return PreparedAudio(
            features.to(torch.float32),
            audio_tokens(frames),
            (frames,),
            audio_feature_lens=frames,
        )

    def features(self, clips: Sequence[PreparedAudio]) -> list[torch.Tensor]:
        """One forward of the model's audio encoder and projector over ``clips``: one
        ``(tokens, hidden)`` tensor each, in the model's dtype."""
        vlm = self.vlm
        with torch.inference_mode():
            rows = _ROWS[self.model_type](vlm.model, clips, vlm.device, vlm.dtype)
            return [row.to(vlm.dtype).contiguous() for row in rows]


def _qwen2_audio_rows(
    model: Any, clips: Sequence[PreparedAudio], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Qwen2-Audio's audio embeddings as its forward computes them: the tower over the padded
    features with a mask of each clip's frames after its stride-2 convolution, the
    projector, and each clip's first :func:`audio_tokens` rows."""
    from transformers.masking_utils import create_bidirectional_mask

    model = model.model
    tower = model.audio_tower
    features = torch.stack([clip.pixels for clip in clips]).to(device)
    frames = torch.tensor([clip.audio_feature_lens for clip in clips], device=device)
    after_conv, _ = tower._get_feat_extract_output_lengths(frames)
    length = (features.shape[-1] - 2) // 2 + 1
    mask = (torch.arange(length, device=device)[None, :] < after_conv[:, None]).to(torch.long)
    attention = create_bidirectional_mask(
        config=tower.config,
        inputs_embeds=torch.zeros((len(clips), length, 1), dtype=dtype, device=device),
        attention_mask=mask,
    )
    hidden = tower(features, attention_mask=attention).last_hidden_state
    projected = model.multi_modal_projector(hidden)
    return [projected[index, : clip.tokens] for index, clip in enumerate(clips)]


def _omni_rows(
    model: Any, clips: Sequence[PreparedAudio], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Qwen2.5-Omni's thinker: its ``get_audio_features`` on each clip's features with its
    frames' mask (it packs the frames and splits them into its attention windows itself). One
    call a clip: its convolutions run over all the clips of a call as one batch, whose kernels
    round differently with the batch's shape, and a clip's rows must not depend on what it is
    batched with."""
    rows = []
    for clip in clips:
        frames = int(clip.pixels.shape[-1])
        mask = (torch.arange(frames) < clip.audio_feature_lens).to(torch.long)[None, :]
        out = model.get_audio_features(
            input_features=clip.pixels[None].to(device), feature_attention_mask=mask.to(device)
        )
        rows.append(out.last_hidden_state)
    return rows


_ROWS: dict[
    str,
    Callable[[Any, Sequence[PreparedAudio], torch.device, torch.dtype], list[torch.Tensor]],
] = {"qwen2_audio": _qwen2_audio_rows, "qwen2_5_omni": _omni_rows}
"""Each family's audio forward, by ``model_type`` (the families of
:data:`FAMILY_EXTRACTOR_KWARGS`)."""
