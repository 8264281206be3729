"""Quantized checkpoints as they are published: the scheme from the checkpoint's `quantization_config`
(scheme.py), each format's tensors read into one of two forms (readers.py -> forms.py), and the loader's step
that turns a half's raw tensors into what its modules hold (load.py). checks.py refuses a bad checkpoint before
any weight is loaded."""
