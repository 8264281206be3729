"""Ask the running server about a synthetic red circle with the official OpenAI client."""
from __future__ import annotations

import argparse
import base64
import io

from openai import OpenAI
from PIL import Image, ImageDraw


def red_circle_data_url() -> str:
    img = Image.new("RGB", (64, 64), (128, 128, 128))
    ImageDraw.Draw(img).ellipse((12, 12, 52, 52), fill="red")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="demo")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
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
