"""Ask the running server about a synthetic red circle (or, with --video or --audio, a short clip made here) with the
official OpenAI client."""
from __future__ import annotations

import argparse
import base64
import io
import math
import struct
import wave
from fractions import Fraction
from typing import Any, cast

import av
from openai import OpenAI
from PIL import Image, ImageDraw


def red_circle_data_url() -> str:
    img = Image.new("RGB", (64, 64), (128, 128, 128))
    ImageDraw.Draw(img).ellipse((12, 12, 52, 52), fill="red")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def moving_square_clip(num_frames: int = 8, fps: int = 4, size: int = 64) -> bytes:
    """An MP4 (H.264) of a red square crossing a grey frame, made with PyAV, so trying video needs no file at hand."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = cast(av.VideoStream, out.add_stream("libx264", rate=Fraction(fps)))
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast"}
        for i in range(num_frames):
            img = Image.new("RGB", (size, size), (128, 128, 128))
            left = (size - size // 4) * i // max(1, num_frames - 1)
            ImageDraw.Draw(img).rectangle((left, size * 3 // 8, left + size // 4 - 1, size * 5 // 8), fill="red")
            out.mux(stream.encode(av.VideoFrame.from_image(img)))
        out.mux(stream.encode())  # flush the encoder
    return buf.getvalue()


def video_request(model: str) -> dict[str, Any]:
    """The --video chat request: the clip inline as a `video_url` part (vLLM's form), greedy, a few tokens."""
    url = "data:video/mp4;base64," + base64.b64encode(moving_square_clip()).decode()
    return {"model": model, "temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What happens in this video?"}]}]}


def tone_wav(seconds: float = 2.0, freq: float = 440.0, rate: int = 16_000) -> bytes:
    """A WAV (16-bit mono PCM) of a sine tone, made with the standard library, so trying audio needs no file."""
    frames = b"".join(struct.pack("<h", round(12_000 * math.sin(2 * math.pi * freq * i / rate)))
                      for i in range(round(seconds * rate)))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(frames)
    return buf.getvalue()


def audio_request(model: str) -> dict[str, Any]:
    """The --audio chat request: the tone inline as an `input_audio` part (OpenAI's form), greedy, a few tokens."""
    data = base64.b64encode(tone_wav()).decode()
    return {"model": model, "temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "text", "text": "What do you hear?"}]}]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="demo")
    p.add_argument("--video", action="store_true",
                   help="send a 2 s clip made here instead of the picture (needs a model that takes video, such as "
                        "a tiny qwen2_vl: see the README's Video inputs; the demo model answers video_not_supported)")
    p.add_argument("--audio", action="store_true",
                   help="send a 2 s tone made here instead of the picture (needs a model that takes audio, such as "
                        "a tiny qwen2_audio: see the README's Audio inputs; the demo model answers audio_not_supported)")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    if args.audio:
        resp = client.chat.completions.create(**audio_request(args.model))
        print(f"What do you hear? -> {resp.choices[0].message.content!r}  (usage: {resp.usage})")
        return
    if args.video:
        resp = client.chat.completions.create(**video_request(args.model))
        print(f"What happens in this video? -> {resp.choices[0].message.content!r}  (usage: {resp.usage})")
        return
    for question in ("What color is the shape?", "What shape is it?"):
        resp = client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": red_circle_data_url()}},
                {"type": "text", "text": question}]}],
        )
        print(f"{question} -> {resp.choices[0].message.content!r}  (usage: {resp.usage})")


if __name__ == "__main__":
    main()
