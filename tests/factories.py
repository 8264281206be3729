"""Small factories shared by tests."""
from __future__ import annotations

from PIL import Image, ImageDraw


def make_image(width: int, height: int, color: str = "red", shape: str = "circle") -> Image.Image:
    img = Image.new("RGB", (width, height), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(width // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=color)
    return img
