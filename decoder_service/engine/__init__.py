"""The decoder's engine, in nano-vllm's shape: `LLMEngine.step` -> `Scheduler.schedule` -> `ModelRunner.run` -> postprocess.

Everything here runs on the engine thread (llm_engine.py says what may be called from elsewhere); the service shell
around it (server, request preparation, gather) lives in decoder_service/.
"""
