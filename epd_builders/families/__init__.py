"""One tiny-checkpoint builder per family: `build(spec) -> Built` (config, processor, tokenizer)."""
