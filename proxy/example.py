"""Ask the running server about a synthetic red circle (or, with --video, a short clip made here) with the official
OpenAI client."""
from __future__ import annotations

import argparse
import base64
import io
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="demo")
    p.add_argument("--video", action="store_true",
                   help="send a 2 s clip made here instead of the picture (needs a model that takes video, such as "
                        "a tiny qwen2_vl: see the README's Video inputs; the demo model answers video_not_supported)")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
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
