"""The OpenAI chat-completions request, as far as the proxy reads it (pydantic at the edge only)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, logprobs=false, ...)

    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False

    def num_images(self) -> int:
        return sum(isinstance(p, ImagePart) for m in self.messages if isinstance(m.content, list) for p in m.content)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # extension, as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    ignore_eos: bool = False  # extension, as in vLLM

    def sampling(self) -> dict[str, Any]:
        """The decoder's sampling fields."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "seed": self.seed,
            "stop": stop,
            "ignore_eos": self.ignore_eos,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
        }


class InstanceRequest(BaseModel):
    """POST/DELETE /instances: a worker to add or remove."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["encoder", "decoder"]
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+$", max_length=512,
                              description="the worker's base URL, e.g. http://10.0.0.7:8001")]
