"""Tensor parallelism: rank 0 (the decoder process: HTTP, scheduler, engine loop) and the ranks it starts, which run
the language model's forward in lockstep on the step rank 0 sends them (ranks.py, worker.py, wire.py)."""
