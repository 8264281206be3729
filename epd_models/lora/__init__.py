"""LoRA adapters on the language model (vLLM's --enable-lora): the PEFT format read and checked (peft_format.py) and
linears that add each row's adapter in a packed forward (layers.py)."""
