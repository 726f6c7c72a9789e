# Everything is set up from scratch in .venv: the CPU torch wheel first (anything that pulls plain `torch`
# first gets a multi-GB CUDA build), then the package with its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Ann has 12 apples. She buys 5 more. Then she gives away 3. How many apples does Ann have now?

.PHONY: install test lint demo embedded-bundle

$(STAMP): setup.cfg pyproject.toml
	@# bubblewrap and libseccomp's Python bindings (for Debian's python3): the OS sandbox for generated code and
	@# its system-call filter (refusion eval --allow-code-execution and its tests)
	{ command -v bwrap >/dev/null && /usr/bin/python3 -c 'import seccomp' 2>/dev/null; } || \
		{ [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3-seccomp >/dev/null; } || \
		{ echo "install bubblewrap and python3-seccomp (sudo apt-get install bubblewrap python3-seccomp): the" \
		"code-execution sandbox needs them" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/python -m pytest

demo: install
	$(BIN)/refusion generate "$(PROMPT)" --show-order

# Rewrite the embedded model folder's remote code and custom_generate/ from the current sources (a test checks
# that they are what save_pretrained writes).
embedded-bundle: install
	$(BIN)/python -c "from refusion_hf.modeling.loading import default_model_path; from refusion_hf.modeling.remote_code import write_model_bundle; print(write_model_bundle(default_model_path()))"
