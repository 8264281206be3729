"""The tiny audio checkpoints: each family builds, loads through AutoProcessor and its model class, runs
its processor on numpy waveforms (no torchaudio, librosa or torchvision), generates, writes as many audio tokens as
`audio_tokens` predicts, and splits: its audio tower run apart from the LM and merged into the LM's embeddings gives
the full forward's logits bit for bit (the split the EPD adapter will make)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoProcessor
from transformers.masking_utils import create_bidirectional_mask
from transformers.processing_utils import ProcessorMixin

from epd_builders.audio_tiny import (
    AUDIO_FAMILIES,
    SAMPLING_RATE,
    AudioTinySpec,
    audio_tokens,
    build_audio_tiny,
    model_class,
    window_seconds,
)
from epd_builders.families import qwen2_5_omni
from epd_models.audio import AudioClip
from epd_models.audio_processors import register_audio_processors
from epd_models.phi4_multimodal import WINDOW_ROWS, chunk_frames, encode_windows
from tests.factories import make_image

register_audio_processors()
QUESTION = "What is it?"


class Loaded:
    def __init__(self, family: str, model_dir: Path):
        self.family = family
        self.processor: Any = AutoProcessor.from_pretrained(model_dir)
        # unregistered, AutoProcessor gives Omni's and Phi-4's directories a bare tokenizer
        assert ProcessorMixin in type(self.processor).__mro__, type(self.processor)
        self.model = model_class(family).from_pretrained(model_dir).eval()
        self.audio_token_id = int(self.processor.audio_token_id)

    def inputs(self, samples: int, image: bool = False) -> Any:
        parts: list[dict[str, Any]] = [{"type": "image"}] if image else []
        parts += [{"type": "audio"}, {"type": "text", "text": QUESTION}]
        text = self.processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                  add_generation_prompt=True)
        extra = {"images": [make_image(112, 84, "blue")]} if image else {}
        return self.processor(text=text, audio=[sine(samples)], sampling_rate=SAMPLING_RATE, return_tensors="pt",
                              **extra)


def sine(samples: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(samples) / SAMPLING_RATE
    return (0.5 * np.sin(2 * np.pi * freq * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


@pytest.fixture(scope="module")
def audio_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-audio")
    return {f: build_audio_tiny(AudioTinySpec(family=f, lm_scale=3.0), root / f) for f in AUDIO_FAMILIES}


@pytest.fixture(scope="module")
def loaded(audio_model_dirs: dict[str, Path]) -> dict[str, Loaded]:
    return {f: Loaded(f, d) for f, d in audio_model_dirs.items()}


def clips(family: str) -> tuple[int, int]:
    """Sample counts: a 1 s clip (and a part of a 10 ms hop: the rounding) and one 5 s past the family's window."""
    return SAMPLING_RATE + 37, (window_seconds(family) + 5) * SAMPLING_RATE


# the audio half, as an encoder would run it: processor outputs -> one (tokens, hidden) tensor of rows per clip


def qwen2_audio_rows(model: Any, inputs: Any) -> list[torch.Tensor]:
    base = model.model
    feats, mask = inputs["input_features"], inputs["feature_attention_mask"]
    conv_lens, out_lens = base.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))
    # the tower's attention mask over its conv frames, as Qwen2AudioModel.forward builds it
    frames = (feats.shape[-1] - 2) // 2 + 1
    valid = (torch.arange(frames)[None, :] < conv_lens[:, None]).long()
    attn = create_bidirectional_mask(config=base.audio_tower.config, inputs_embeds=torch.zeros(len(feats), frames, 1),
                                     attention_mask=valid)
    hidden = base.multi_modal_projector(base.audio_tower(feats, attention_mask=attn).last_hidden_state)
    return [h[:n] for h, n in zip(hidden, out_lens.tolist(), strict=True)]


def omni_rows(model: Any, inputs: Any) -> list[torch.Tensor]:
    mask = inputs["feature_attention_mask"]
    rows = model.model.get_audio_features(inputs["input_features"], mask).last_hidden_state
    _, out_lens = model.model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))
    return list(torch.split(rows, out_lens.tolist()))


def phi4_rows(model: Any, inputs: Any, with_image: bool = False) -> list[torch.Tensor]:
    emb = model.model.embed_tokens_extend.audio_embed
    up, down = ((emb.up_proj_for_vision_speech, emb.down_proj_for_vision_speech) if with_image
                else (emb.up_proj_for_speech, emb.down_proj_for_speech))
    hidden = emb.encoder(inputs["audio_input_features"], inputs.get("audio_attention_mask"))
    rows = down(torch.nn.functional.gelu(up(hidden)))
    return [r[:n] for r, n in zip(rows, inputs["audio_embed_sizes"].tolist(), strict=True)]


ROWS = {"qwen2_audio": qwen2_audio_rows, "qwen2_5_omni": omni_rows, "phi4_multimodal": phi4_rows}


def scatter(embeds: torch.Tensor, ids: torch.Tensor, token_id: int, rows: list[torch.Tensor]) -> torch.Tensor:
    """The decoder's merge: rows, in prompt order, into the positions of `token_id`."""
    mask = (ids == token_id).unsqueeze(-1).expand_as(embeds)
    return embeds.masked_scatter(mask, torch.cat(rows).to(embeds.dtype))


def split_logits(item: Loaded, inputs: Any, image_rows: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The LM half: text embeddings, the encoder's rows merged in, the LM and lm_head alone."""
    model, ids, attn = item.model, inputs["input_ids"], inputs["attention_mask"]
    rows = ROWS[item.family](model, inputs)
    if item.family == "phi4_multimodal":  # the LM is the base model itself; the towers sit in embed_tokens_extend
        embeds = scatter(model.model.embed_tokens(ids), ids, item.audio_token_id, rows)
        hidden = model.model(inputs_embeds=embeds, attention_mask=attn).last_hidden_state
        return model.lm_head(hidden)
    lm = model.model.language_model
    embeds = scatter(lm.embed_tokens(ids), ids, item.audio_token_id, rows)
    positions = None
    if item.family == "qwen2_5_omni":  # M-RoPE: an audio token takes one text position (3 equal axes)
        if image_rows is not None:
            embeds = scatter(embeds, ids, model.config.image_token_id, image_rows)
        positions, _ = model.model.get_rope_index(ids, inputs.get("image_grid_thw"), None, attn, False,
                                                  inputs["feature_attention_mask"].sum(-1))
    hidden = lm(inputs_embeds=embeds, attention_mask=attn, position_ids=positions).last_hidden_state
    return model.lm_head(hidden)


@pytest.mark.parametrize("family", AUDIO_FAMILIES)
def test_placeholders_match_audio_tokens(loaded: dict[str, Loaded], family: str) -> None:
    item = loaded[family]
    for samples in clips(family):
        inputs = item.inputs(samples)
        count = int((inputs["input_ids"] == item.audio_token_id).sum())
        assert count == audio_tokens(family, samples, item.processor), (family, samples)
        assert count == sum(r.shape[0] for r in ROWS[family](item.model, inputs))
        if family == "qwen2_5_omni":  # what vLLM asks the processor
            mm = item.processor._get_num_multimodal_tokens(audio_lengths=[samples])
            assert mm.num_audio_tokens == [count]


@pytest.mark.parametrize("family", AUDIO_FAMILIES)
@torch.inference_mode()
def test_generate_and_split_logits(loaded: dict[str, Loaded], family: str) -> None:
    item = loaded[family]
    for samples in clips(family):
        inputs = item.inputs(samples)
        out = item.model.generate(**inputs, max_new_tokens=4, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1]:]
        assert new.shape == (4,) and int(new.max()) < len(item.processor.tokenizer)
        full = item.model(**inputs).logits
        split = split_logits(item, inputs)
        torch.testing.assert_close(split, full, rtol=0, atol=0, msg=f"{family} {samples}")


def test_token_formulas() -> None:
    """Qwen: 25 tokens per second (a 40 ms token: 10 ms mel hops, conv stride 2, pooling 2); Qwen2-Audio stops at
    its 30 s window, Qwen2.5-Omni at 300 s. Phi-4: ceil(frames / 8), 12.5 per second, no cap."""
    class FE:
        n_samples, hop_length, win_length, audio_compression_rate, audio_downsample_rate = 30 * SAMPLING_RATE, 160, 400, 8, 1

    class Proc:
        feature_extractor = audio_processor = FE()

    assert [audio_tokens("qwen2_audio", s * SAMPLING_RATE, Proc()) for s in (1, 2, 30, 60)] == [25, 50, 750, 750]
    # 102 frames give 25 tokens, 103 give 26: a partial 10 ms hop counts as a frame
    assert [audio_tokens("qwen2_audio", n, Proc()) for n in (16320, 16321)] == [25, 26]
    assert [audio_tokens("phi4_multimodal", s * SAMPLING_RATE, Proc()) for s in (1, 40, 120)] == [13, 500, 1500]


@torch.inference_mode()
def test_qwen2_audio_cuts_clips_at_its_window(loaded: dict[str, Loaded]) -> None:
    """Past 30 s the processor drops the rest: a 35 s clip's features are its first 30 s's exactly."""
    item = loaded["qwen2_audio"]
    fe = item.processor.feature_extractor
    wav = sine(35 * SAMPLING_RATE)
    longer = fe(wav, sampling_rate=SAMPLING_RATE, padding="max_length", return_tensors="pt")["input_features"]
    cut = fe(wav[: 30 * SAMPLING_RATE], sampling_rate=SAMPLING_RATE, padding="max_length",
             return_tensors="pt")["input_features"]
    assert torch.equal(longer, cut)


@torch.inference_mode()
def test_omni_windows_encode_independently(loaded: dict[str, Loaded]) -> None:
    """Qwen2.5-Omni's tower gives each 2 s window (200 mel frames) rows of its own: a 7 s clip's rows are its
    windows' rows, each window's features run through the tower alone, concatenated in order (so windows can be
    spread over encoders). Equal to the last bits only: the conv before the windows' attention picks its kernel by
    batch size (here one window alone differs by < 1e-7 from four together; the real 1280-channel conv agreed bit for
    bit on this CPU). The features themselves must come from the whole clip (the log-mel floor is the clip's
    maximum - 8), then be cut at window edges."""
    item = loaded["qwen2_5_omni"]
    inputs = item.inputs(7 * SAMPLING_RATE)
    feats = inputs["input_features"][0, :, : int(inputs["feature_attention_mask"].sum())]
    whole = omni_rows(item.model, inputs)[0]
    size = qwen2_5_omni.window_frames(item.model.config)
    parts = []
    for start in range(0, feats.shape[1], size):
        chunk = feats[:, start:start + size]
        parts.append(item.model.model.get_audio_features(chunk[None], torch.ones(1, chunk.shape[1],
                                                                                 dtype=torch.long)).last_hidden_state)
    assert [p.shape[0] for p in parts] == [50, 50, 50, 25]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_phi4_windows_encode_independently(loaded: dict[str, Loaded]) -> None:
    """Phi-4's encoder attends within 500-row windows (40 s): a 45 s clip's rows are its two windows' rows, each
    computed apart from its own frames (and 8 before it), bit for bit: windows can be spread over encoders, by a
    path of our own (the adapter's `encode_windows`; the stock forward takes the whole clip). Its log-mel frames are
    local (no clip-wide floor)."""
    item = loaded["phi4_multimodal"]
    inputs = item.inputs((window_seconds("phi4_multimodal") + 5) * SAMPLING_RATE)
    encoder = item.model.model.embed_tokens_extend.audio_embed.encoder
    feats = inputs["audio_input_features"]
    whole = encoder(feats, None)[0]
    parts = []
    for k in range(-(-whole.shape[0] // WINDOW_ROWS)):
        frames, lead = chunk_frames(feats.shape[1], 8, AudioClip(np.zeros(0, np.float32), k, 1))
        parts.append(encode_windows(encoder, feats[:, frames], feats.shape[1], lead))
    assert [p.shape[0] for p in parts] == [500, 63]
    assert torch.equal(torch.cat(parts), whole)


@torch.inference_mode()
def test_omni_image_and_audio_split(loaded: dict[str, Loaded]) -> None:
    """An image before the audio: the image's rows (vision tower) and the clip's (audio tower), merged at their own
    tokens, with M-RoPE positions from the image grid and the clip's feature length, give the full logits."""
    item = loaded["qwen2_5_omni"]
    inputs = item.inputs(3 * SAMPLING_RATE, image=True)
    image = item.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    torch.testing.assert_close(split_logits(item, inputs, list(image)), item.model(**inputs).logits, rtol=0, atol=0)


def test_no_torchaudio_librosa_or_torchvision(loaded: dict[str, Loaded]) -> None:
    """Every path above ran without them (the project never installs them)."""
    assert loaded
    assert not [m for m in ("torchaudio", "librosa", "torchvision", "soundfile") if m in sys.modules]
