# Everything is set up from scratch in .venv: the CPU torch wheel first (anything that pulls plain `torch`
# first gets a multi-GB CUDA build), then the package with its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROMPT ?= For the numbers 2, 24, 27, 12, 10, subtract 7 from each number. Write one line each.

.PHONY: install test test-matrix lint demo embedded-bundle

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
