# Everything is set up from scratch in .venv: the CPU torch wheel first (anything that pulls plain `torch`
# first gets a multi-GB CUDA build), then the package with its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROMPT ?= For the numbers 2, 24, 27, 12, 10, subtract 7 from each number. Write one line each.

.PHONY: install test test-matrix lint demo embedded-bundle sglang test-sglang

$(STAMP): setup.cfg pyproject.toml setup.py
	@# bubblewrap and libseccomp's Python bindings (for Debian's python3): the OS sandbox for generated code and
	@# its system-call filter (refusion eval --allow-code-execution and its tests)
	{ command -v bwrap >/dev/null && /usr/bin/python3 -c 'import seccomp' 2>/dev/null; } || \
		{ [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3-seccomp >/dev/null; } || \
		{ echo "install bubblewrap and python3-seccomp (sudo apt-get install bubblewrap python3-seccomp): the" \
		"code-execution sandbox needs them" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"  # setup.py also writes the embedded model's remote code into src/
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check setup.py noxfile.py src tests benchmarks
	$(BIN)/ruff format --check setup.py noxfile.py src tests benchmarks

test: lint embedded-bundle
	$(BIN)/python -m pytest

# The release subset under the oldest and the newest supported dependency sets, each in a fresh virtual environment
# (noxfile.py; tests/README.md gives the subset and its time). `$(BIN)/nox -s oldest` runs one end.
test-matrix: install
	$(BIN)/nox

demo: install
	$(BIN)/refusion generate "$(PROMPT)" --show-order

# Rewrite the embedded model folder's remote code and custom_generate/ in src/ from the current sources: what
# setup.py's build_py writes at install time (git-ignored), refreshed after a source change (`make test` does it
# first; a test checks that they are what save_pretrained writes).
embedded-bundle: install
	$(BIN)/python -c "from refusion_hf.modeling.remote_code import write_embedded_bundle; print(len(write_embedded_bundle()), 'files')"

# SGLang 0.5.23 with ReFusion decoding (`--dllm-algorithm ReFusion`, docs/serving.md) in its own venv, from the registry
# alone. SGLang pins CUDA builds (torch 2.14.1, sglang-kernel, flashinfer), so on a CPU-only machine: the CPU torch
# wheel first, SGLang without its dependencies, then the pure-Python ones it imports (tests/sglang_cpu_scaffold/);
# torchvision's pure-Python part only (the registry's wheel links CUDA: its extension modules are deleted). The CPU
# test scaffolding (a pure-torch stand-in for sgl-kernel's one CPU op, and torchvision's op schemas) goes on the
# venv's path only where `import sgl_kernel` fails there, so sgl-kernel's own build always wins.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed-stamp
SGLANG_SCAFFOLD := tests/sglang_cpu_scaffold

$(SGLANG_STAMP): setup.cfg $(SGLANG_SCAFFOLD)/requirements.txt $(SGLANG_SCAFFOLD)/constraints.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet torch==2.13.0
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==0.5.23 triton torchvision==0.28.0
	PIP_CONSTRAINT=$(SGLANG_SCAFFOLD)/constraints.txt $(SGLANG_VENV)/bin/pip install --quiet \
		-r $(SGLANG_SCAFFOLD)/requirements.txt pytest
	@# the package with what `refusion serve --engine sglang` imports (the `serving` extra), under the same pins
	PIP_CONSTRAINT=$(SGLANG_SCAFFOLD)/constraints.txt $(SGLANG_VENV)/bin/pip install --quiet -e ".[serving]"
	find $$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torchvision \
		-name '*.so' -delete
	$(SGLANG_VENV)/bin/python -c 'import sgl_kernel' 2>/dev/null || \
		printf '%s\nimport refusion_sglang_cpu_torchvision\n' "$$(pwd)/$(SGLANG_SCAFFOLD)" > \
		$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/refusion-sglang-cpu-scaffold.pth
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_VENV)/bin/python -c 'import sglang.srt.entrypoints.engine, refusion_hf.serving.sglang_plugin'
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

# The SGLang tests (one engine or server per module; start-up 30-70 s each) in .venv-sglang; `.ci/run` calls it
# after `make test-matrix`
test-sglang: sglang
	$(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/serving/test_sglang.py tests/serving/test_sglang_official.py \
		tests/serving/test_sglang_serve.py tests/serving/test_sglang_launch.py tests/serving/test_sglang_engine_throughput.py \
		tests/_compat/test_sglang.py
