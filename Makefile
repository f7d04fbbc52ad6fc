# Every command a person or CI runs. `make test` sets up everything it needs on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.ext-built
RUST   := $(shell find rust -name '*.rs') Cargo.toml pyproject.toml

.PHONY: all test test-rust test-python bench bench-rust bench-python demo replay lint fmt wheel clean

all: test

# The virtual environment sees packages already installed system-wide (so a machine that has
# torch does not download a second copy); pip installs whatever is missing.
$(DEPS): requirements-dev.txt
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	# maturin runs as a script of the environment it builds into, so it lives inside the venv.
	$(PY) -m pip install --quiet --disable-pip-version-check --ignore-installed 'maturin>=1.5,<2'
	touch $@

$(EXT): $(DEPS) $(RUST)
	VIRTUAL_ENV=$(abspath $(VENV)) $(PY) -m maturin develop --release --quiet
	touch $@

develop: $(EXT)

test: test-rust test-python

test-rust:
	cargo test --quiet

test-python: $(EXT)
	$(PY) -m pytest -q tests/python

bench: bench-rust bench-python

bench-rust:
	cargo bench --bench cache --bench scheduler

bench-python: $(EXT)
	$(PY) benches/bench_cache.py
	$(PY) benches/bench_scheduler.py
	$(PY) benches/bench_torch.py --threads 1

demo: $(EXT)
	$(PY) -m radixkv demo

replay: $(EXT)
	$(PY) -m radixkv replay ../shared/traces/mooncake_conversation_trace.jsonl

lint: $(EXT)
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python -- -D warnings
	cargo fmt --check
	$(PY) -m ruff check python tests benches
	$(PY) -m ruff format --check python tests benches
	$(PY) -m mypy.stubtest radixkv._radixkv

fmt: $(DEPS)
	cargo fmt
	$(PY) -m ruff format python tests benches

wheel: $(DEPS)
	$(PY) -m maturin build --release

clean:
	cargo clean
	rm -rf $(VENV) python/radixkv/*.so
