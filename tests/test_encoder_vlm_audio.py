"""An audio clip through Qwen2-Audio's own audio path: a tiny random-weight model built from
its config and saved with its Whisper feature extractor, and clips of several lengths.

The rows are, to the bit in float32, the audio embeddings the full model's own forward merges
into its prompt (read where they enter its language model) for the same clips through the
model's own processor; the token count is the ``<|AUDIO|>`` tokens that processor puts in the
prompt; the frame count is what SGLang's encoder sends its prefill (the feature mask's sum).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from support.vlms import _without_video, photo, tiny_tokenizer
from trio_encode.encoder import EncoderSettings
from trio_encode.encoder.audio import AudioTooLong, DecodedAudio, decode_audio
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.encoder.vlm_audio import (
    DEFAULT_SAMPLING_RATE,
    AudioPath,
    PreparedAudio,
    audio_tokens,
    sampling_rate,
)
from trio_encode.errors import InvalidInput
from trio_encode.testing.tiny_vlm import (
    OMNI_CHECKPOINT_NAMES,
    save_tiny_qwen2_5_omni,
    save_tiny_qwen2_audio,
    tiny_parts,
)

AUDIO_TOKEN = "<|AUDIO|>"
SECONDS = (0.3, 1.0, 7.37, 30.0)
"""Clip lengths: a few frames, one second, an odd length, the whole window."""


def clip(seconds: float, seed: int = 0, rate: int = 16_000) -> DecodedAudio:
    """Noise over a tone, as decoded at ``rate``."""
    n = round(seconds * rate)
    rng = np.random.default_rng(seed)
    t = np.arange(n) / rate
    samples = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(n)
    return DecodedAudio(samples.astype(np.float32), rate, "pcm_f32le", rate, 1)


@dataclass
class Tiny:
    path: Path
    vlm: VLMVisionModel
    audio: AudioPath
    processor: Any
    """The model's own transformers processor (with a tiny tokenizer)."""
    token_id: int

    def reference(self, samples: list[npt.NDArray[np.float32]]) -> tuple[list[torch.Tensor], Any]:
        """The full model's forward on these clips through its processor: the audio
        embeddings it merges into its prompt, per clip, and the processor's output."""
        model = T.Qwen2AudioForConditionalGeneration.from_pretrained(
            str(self.path), dtype=torch.float32
        ).eval()
        text = [f"describe {AUDIO_TOKEN} this" for _ in samples]
        inputs = self.processor(text=text, audio=samples, return_tensors="pt", padding=True)
        seen: dict[str, torch.Tensor] = {}

        def grab(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            seen["embeds"] = kwargs["inputs_embeds"]

        hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.inference_mode():
                model(**inputs)
        finally:
            hook.remove()
        where = inputs["input_ids"] == self.token_id
        rows = [seen["embeds"][index][where[index]] for index in range(len(samples))]
        return rows, inputs


def build(path: Path) -> Tiny:
    tokenizer = tiny_tokenizer({"audio_token": AUDIO_TOKEN})
    token_id = int(tokenizer.convert_tokens_to_ids(AUDIO_TOKEN))
    save_tiny_qwen2_audio(path, audio_token_id=token_id)
    vlm = VLMVisionModel(
        EncoderSettings(model=path, warmup=False), json.loads((path / "config.json").read_text())
    )
    audio = AudioPath.for_model(vlm, path)
    assert audio is not None
    extractor = T.WhisperFeatureExtractor.from_pretrained(str(path))
    processor = T.Qwen2AudioProcessor(extractor, tokenizer, audio_token=AUDIO_TOKEN)
    return Tiny(path, vlm, audio, processor, token_id)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return build(tmp_path_factory.mktemp("qwen2_audio"))


@pytest.mark.parametrize("seconds", SECONDS)
def test_rows_are_what_the_models_own_forward_merges(tiny: Tiny, seconds: float) -> None:
    decoded = clip(seconds)
    prepared = tiny.audio.prepare(decoded)
    (rows,) = tiny.audio.features([prepared])
    (expected,), inputs = tiny.reference([decoded.samples])
    assert torch.equal(prepared.pixels, inputs["input_features"][0])
    assert rows.dtype == torch.float32
    assert rows.shape == expected.shape == (prepared.tokens, tiny.vlm.hidden_size)
    assert torch.equal(rows, expected)
    # The processor's count of <|AUDIO|> tokens, and the frames SGLang's encoder sends.
    assert prepared.tokens == int((inputs["input_ids"] == tiny.token_id).sum())
    assert prepared.audio_feature_lens == int(inputs["feature_attention_mask"].sum())
    assert prepared.grid == (prepared.audio_feature_lens,)
    assert prepared.grid == (prepared.audio_feature_lens,)
    assert prepared.meta == ()


def test_preparing_is_thread_safe(tiny: Tiny) -> None:
    decoded = [clip(seconds, seed) for seed, seconds in enumerate(SECONDS)]
    alone = [tiny.audio.prepare(one).pixels for one in decoded]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda one: tiny.audio.prepare(one).pixels, decoded * 3))
    for got, expected in zip(together, alone * 3, strict=True):
        assert torch.equal(got, expected)


def test_clips_of_different_lengths_share_a_forward(tiny: Tiny) -> None:
    decoded = [clip(seconds, seed) for seed, seconds in enumerate(SECONDS)]
    prepared = [tiny.audio.prepare(one) for one in decoded]
    together = tiny.audio.features(prepared)
    expected, _ = tiny.reference([one.samples for one in decoded])
    for rows, alone, theirs in zip(together, prepared, expected, strict=True):
        assert torch.equal(rows, theirs)
        assert torch.equal(rows, tiny.audio.features([alone])[0])


@pytest.mark.parametrize(
    ("seconds", "frames", "tokens"),
    [
        # 100 log-mel frames a second (hop 160 at 16 kHz); the stride-2 convolution, then
        # the stride-2 pooling: (100 - 1) // 2 + 1 = 50, (50 - 2) // 2 + 1 = 25.
        (1.0, 100, 25),
        (0.3, 30, 7),
        (7.37, 737, 184),  # 369, then 184
        (30.0, 3000, 750),
    ],
)
def test_lengths_are_sglangs(tiny: Tiny, seconds: float, frames: int, tokens: int) -> None:
    prepared = tiny.audio.prepare(clip(seconds))
    assert (prepared.audio_feature_lens, prepared.tokens) == (frames, tokens)
    assert audio_tokens(frames) == tokens
    assert prepared.pixels.shape == (128, 3000)  # padded to the window, as SGLang pads


def test_a_clip_longer_than_the_window_is_refused(tiny: Tiny) -> None:
    with pytest.raises(AudioTooLong, match=r"30\.1 seconds.*at most 30 seconds") as caught:
        tiny.audio.prepare(clip(30.1))
    assert caught.value.status == 413


def test_a_clip_at_another_rate_is_a_bug(tiny: Tiny) -> None:
    with pytest.raises(ValueError, match="22050 Hz"):
        tiny.audio.prepare(clip(1.0, rate=22_050))


def test_decoded_bytes_go_through(tiny: Tiny) -> None:
    import io

    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=44_100, layout="mono")
        assert isinstance(stream, av.AudioStream)
        samples = (clip(2.0, rate=44_100).samples * 32767).astype(np.int16)[None]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = 44_100
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    decoded = decode_audio(buffer.getvalue(), tiny.audio.sampling_rate)
    prepared = tiny.audio.prepare(decoded)
    assert (prepared.audio_feature_lens, prepared.tokens) == (200, 50)


def test_only_the_audio_modules_are_loaded(tiny: Tiny) -> None:
    model = tiny.vlm.model
    loaded = {name for name, param in model.named_parameters() if not param.is_meta}
    assert loaded
    assert all(
        name.startswith(("model.audio_tower.", "model.multi_modal_projector.")) for name in loaded
    )
    assert model.model.language_model.embed_tokens.weight.is_meta


def test_an_audio_model_takes_no_images(tiny: Tiny) -> None:
    assert tiny.vlm.processor is None
    with pytest.raises(InvalidInput, match=r"\(qwen2_audio\) takes no images"):
        tiny.vlm.decode(photo(0, (32, 32)), max_pixels=10**6)


def test_families_without_an_audio_path_get_none(tmp_path: Path) -> None:
    parts = tiny_parts("qwen2_vl", T)
    parts.model_class(parts.config).save_pretrained(str(tmp_path))
    parts.image_processor.save_pretrained(str(tmp_path))
    vlm = VLMVisionModel(
        EncoderSettings(model=tmp_path, warmup=False),
        json.loads((tmp_path / "config.json").read_text()),
    )
    assert AudioPath.for_model(vlm, tmp_path) is None


@pytest.mark.parametrize(
    ("config", "rate"),
    [
        ({}, DEFAULT_SAMPLING_RATE),
        ({"audio_config": {"sampling_rate": 24_000}}, 24_000),
        ({"audio_config": {"sample_rate": 22_050}}, 22_050),
        (
            {
                "processor_config": {"audio_sampling_rate": 8_000},
                "audio_config": {"sampling_rate": 1},
            },
            8_000,
        ),
        (
            {
                "thinker_config": {
                    "processor_config": {"audio_sampling_rate": 48_000},
                    "audio_config": {"sampling_rate": 1},
                },
                "audio_config": {"sampling_rate": 2},
            },
            48_000,
        ),
        ({"thinker_config": {"audio_config": {"sampling_rate": 32_000}}}, 32_000),
    ],
)
def test_the_sampling_rate_is_resolved_as_sglang_resolves_it(
    config: dict[str, Any], rate: int
) -> None:
    assert sampling_rate(config) == rate


def test_prepared_audio_is_prepared() -> None:
    prepared = PreparedAudio(torch.zeros(128, 3000), 25, (100,), audio_feature_lens=100)
    assert prepared.grid == (100,)
    assert prepared.meta == ()


# -- Qwen2.5-Omni's thinker -----------------------------------------------------------------

OMNI_TOKENS = {
    "audio_token": AUDIO_TOKEN,
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}


@dataclass
class TinyOmni:
    path: Path
    vlm: VLMVisionModel
    audio: AudioPath
    thinker: Any
    """The thinker itself, as transformers builds it, with the saved weights."""
    processor: Any
    token_id: int


def build_omni(path: Path) -> TinyOmni:
    """The tiny Qwen2.5-Omni of ``make-tiny-model`` (laid out as its checkpoints are), its
    thinker as transformers builds it with the saved weights, and its processor."""
    tokenizer = tiny_tokenizer(OMNI_TOKENS)
    ids = {key: int(tokenizer.convert_tokens_to_ids(token)) for key, token in OMNI_TOKENS.items()}
    save_tiny_qwen2_5_omni(
        path,
        token_ids={
            "audio_token_index": ids["audio_token"],
            "image_token_index": ids["image_token"],
            "video_token_index": ids["video_token"],
            "audio_start_token_id": ids["audio_bos_token"],
            "audio_end_token_id": ids["audio_eos_token"],
            "vision_start_token_id": ids["vision_bos_token"],
            "vision_end_token_id": ids["vision_eos_token"],
        },
    )
    config = T.AutoConfig.from_pretrained(str(path))
    thinker = T.Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config).eval()
    stored = load_file(str(path / "model.safetensors"))
    state = {}
    for ours, theirs in OMNI_CHECKPOINT_NAMES:
        state.update(
            {ours + k.removeprefix(theirs): v for k, v in stored.items() if k.startswith(theirs)}
        )
    thinker.load_state_dict(state, strict=True)
    vlm = VLMVisionModel(
        EncoderSettings(model=path, warmup=False), json.loads((path / "config.json").read_text())
    )
    audio = AudioPath.for_model(vlm, path)
    assert audio is not None
    processor = _without_video(T.Qwen2_5OmniProcessor)(
        image_processor=T.Qwen2VLImageProcessor.from_pretrained(str(path)),
        video_processor=None,
        feature_extractor=T.WhisperFeatureExtractor.from_pretrained(str(path)),
        tokenizer=tokenizer,
    )
    return TinyOmni(path, vlm, audio, thinker, processor, ids["audio_token"])


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> TinyOmni:
    return build_omni(tmp_path_factory.mktemp("qwen2_5_omni"))


OMNI_SECONDS = (0.3, 1.0, 7.37, 30.0, 61.3)
"""Clip lengths, one past Qwen2-Audio's window (the thinker's encoder takes any length: it
attends within windows of ``n_window`` frames)."""


def test_omni_rows_are_the_thinkers_own_get_audio_features(omni: TinyOmni) -> None:
    prepared = [omni.audio.prepare(clip(s, seed)) for seed, s in enumerate(OMNI_SECONDS)]
    together = omni.audio.features(prepared)
    # The thinker's own call on the same features, padded to the longest with their mask.
    padded = torch.nn.utils.rnn.pad_sequence([one.pixels.T for one in prepared], batch_first=True)
    frames = torch.tensor([one.audio_feature_lens for one in prepared])
    mask = (torch.arange(padded.shape[1])[None, :] < frames[:, None]).to(torch.long)
    with torch.inference_mode():
        out = omni.thinker.get_audio_features(padded.transpose(1, 2), feature_attention_mask=mask)
    expected = torch.split(out.last_hidden_state, [one.tokens for one in prepared])
    for one, rows, theirs in zip(prepared, together, expected, strict=True):
        assert one.pixels.shape == (128, one.audio_feature_lens)  # a clip alone: no padding
        assert rows.dtype == torch.float32
        assert rows.shape == (one.tokens, omni.vlm.hidden_size)
        assert one.tokens == audio_tokens(one.audio_feature_lens)
        assert one.grid == (one.audio_feature_lens,)
        assert one.meta == ()
        # Each clip's rows are the thinker's own for the clip alone, to the bit, whatever it is
        # batched with; the thinker's batched call differs in the last bits only (its kernels
        # see another batch shape).
        ones = torch.ones((1, one.audio_feature_lens), dtype=torch.long)
        with torch.inference_mode():
            own = omni.thinker.get_audio_features(one.pixels[None], feature_attention_mask=ones)
        assert torch.equal(rows, own.last_hidden_state)
        (alone,) = omni.audio.features([one])
        assert torch.equal(alone, rows)
        torch.testing.assert_close(rows, theirs, rtol=0, atol=1e-6)


def test_omni_features_are_sglangs_for_a_clip_alone(omni: TinyOmni) -> None:
    """SGLang's encoder runs the extractor over its whole batch, padded to the longest clip,
    so a shorter clip's last frame (the spectrogram's edge) depends on its batch; each clip
    here is one batch, which is SGLang's answer for the longest clip of any batch and for a
    clip sent alone."""
    decoded = [clip(s, seed) for seed, s in enumerate(OMNI_SECONDS)]
    kwargs = omni.audio.extractor_kwargs
    batch = omni.audio.extractor([one.samples for one in decoded], return_tensors="pt", **kwargs)
    for index, one in enumerate(decoded):
        prepared = omni.audio.prepare(one)
        alone = omni.audio.extractor([one.samples], return_tensors="pt", **kwargs)
        assert torch.equal(prepared.pixels, alone["input_features"][0])
        frames = prepared.audio_feature_lens
        assert frames == int(batch["attention_mask"][index].sum())
        in_batch = batch["input_features"][index, :, :frames]
        if index == len(decoded) - 1:  # the longest
            assert torch.equal(prepared.pixels, in_batch)
        else:
            assert torch.equal(prepared.pixels[:, :-1], in_batch[:, :-1])
            assert not torch.equal(prepared.pixels[:, -1], in_batch[:, -1])


def test_omni_token_counts_are_its_processors(omni: TinyOmni) -> None:
    """transformers' processor pads every clip to the extractor's window before its
    spectrogram, SGLang's encoder only to the batch's longest clip: the same frame and token
    counts, and rows that differ only through the last frame (the spectrogram's edge), which
    the attention window holding it spreads to its neighbours' last bits."""
    decoded = [clip(seconds, seed) for seed, seconds in enumerate(OMNI_SECONDS)]
    prepared = [omni.audio.prepare(one) for one in decoded]
    text = [f"describe {AUDIO_TOKEN} this" for _ in decoded]
    inputs = omni.processor(
        text=text, audio=[one.samples for one in decoded], return_tensors="pt", padding=True
    )
    counts = (inputs["input_ids"] == omni.token_id).sum(-1).tolist()
    assert [one.tokens for one in prepared] == counts
    frames = inputs["feature_attention_mask"].sum(-1).tolist()
    assert [one.audio_feature_lens for one in prepared] == frames
    seen: dict[str, torch.Tensor] = {}

    def grab(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen["embeds"] = kwargs["inputs_embeds"]

    hook = omni.thinker.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            omni.thinker(**inputs)
    finally:
        hook.remove()
    ours = omni.audio.features(prepared)
    for index, rows in enumerate(ours):
        theirs = seen["embeds"][index][inputs["input_ids"][index] == omni.token_id]
        torch.testing.assert_close(rows, theirs, rtol=0, atol=1e-3)


def test_omni_images_go_through_the_thinkers_vision(omni: TinyOmni) -> None:
    prepared = omni.vlm.decode(photo(1, (90, 60)), max_pixels=10**6)
    (rows,) = omni.vlm.encode([prepared])
    grid = torch.tensor([prepared.grid], dtype=torch.long)
    with torch.inference_mode():
        out = omni.thinker.get_image_features(pixel_values=prepared.pixels, image_grid_thw=grid)
    assert torch.equal(rows, out.pooler_output[0])
    assert rows.shape == (prepared.tokens, omni.vlm.hidden_size)


def test_omni_loads_only_the_thinkers_towers(omni: TinyOmni) -> None:
    model = omni.vlm.model
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    loaded = {name for name, param in model.named_parameters() if not param.is_meta}
    assert loaded
    assert all(name.startswith(("model.audio_tower.", "model.visual.")) for name in loaded)
    assert model.model.language_model.embed_tokens.weight.is_meta


def test_an_omni_clip_past_the_window_is_cut_as_sglang_cuts_it(tmp_path: Path) -> None:
    """SGLang calls the thinker's extractor with its own ``truncation=True``: a clip longer
    than ``n_samples`` is cut there, silently. Here a window of 2 s."""
    omni = build_omni(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    saved.update(chunk_length=2, n_samples=32_000, nb_max_frames=200)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(saved))
    short = AudioPath.for_model(omni.vlm, tmp_path)
    assert short is not None
    prepared = short.prepare(clip(3.5))
    assert (prepared.audio_feature_lens, prepared.tokens) == (200, 50)


def test_omni_padding_frames_are_masked(omni: TinyOmni) -> None:
    """Features padded past the clip's frames (as a batch padded to its longest clip would
    be) give the clip's own rows: the padding is masked, never encoded."""
    one = omni.audio.prepare(clip(1.3, 5))
    padded = replace(one, pixels=torch.cat([one.pixels, torch.zeros(128, 64)], dim=1))
    assert torch.equal(omni.audio.features([padded])[0], omni.audio.features([one])[0])
