"""Validate answers against the official OpenAI schemas (copied from the OpenAPI spec into tests/data)."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

SCHEMA = Path(__file__).parent / "data" / "openai-chat-completions.schema.json"


@lru_cache
def validator(name: str) -> Draft202012Validator:
    doc = json.loads(SCHEMA.read_text())
    return Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": doc["$defs"]})


def assert_valid(name: str, obj: Any) -> None:
    errors = [e.message for e in validator(name).iter_errors(obj)]
    assert not errors, f"{name}: {errors[:3]}"
