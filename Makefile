# Every command a person or CI runs. `make test` sets up everything it needs on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.ext-built
RUST   := $(shell find rust -name '*.rs') Cargo.toml pyproject.toml

.PHONY: all develop test test-rust test-python bench bench-rust bench-python bench-cache demo replay lint fmt wheel clean

all: test

# The virtual environment sees packages already installed system-wide (so a machine that has
# torch does not download a second copy); pip installs whatever is missing.
$(DEPS): requirements-dev.txt
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	# maturin runs as a script of the environment it builds into, so it lives inside the venv.
	$(PY) -m pip install --quiet --disable-pip-version-check --ignore-installed 'maturin>=1.5,<2'
	touch $@

# The extension is built for the stable ABI (_radixkv.abi3.so). Python prefers a version-tagged
# file (_radixkv.cpython-3XX-*.so) over it, so one left by an older build is removed.
$(EXT): $(DEPS) $(RUST)
	VIRTUAL_ENV=$(abspath $(VENV)) $(PY) -m maturin develop --release --quiet
	find python/radixkv -maxdepth 1 -name '_radixkv.*.so' ! -name '_radixkv.abi3.so' -delete
	touch $@

develop: $(EXT)

test: test-rust test-python

test-rust:
	cargo test --quiet

test-python: $(EXT)
	$(PY) -m pytest -q tests/python

bench: bench-rust bench-python

# The cache benchmarks, one file per concept; `make bench-cache BENCH_ARGS=--clock=thread` gives
# the figures in the README (any option common to them: --quick, --no-ref, --clock).
bench-cache: $(EXT)
	$(PY) benches/bench_admit.py $(BENCH_ARGS)
	$(PY) benches/bench_evict.py $(BENCH_ARGS)
	$(PY) benches/bench_agent.py $(BENCH_ARGS)
	$(PY) benches/bench_metadata.py $(BENCH_ARGS)
	$(PY) benches/bench_mooncake.py $(BENCH_ARGS)
	$(PY) benches/bench_boundary.py $(BENCH_ARGS)

bench-rust:
	cargo bench --bench cache --bench scheduler

bench-python: bench-cache
	$(PY) benches/bench_scheduler.py
	$(PY) benches/bench_torch.py --threads 1

demo: $(EXT)
	$(PY) -m radixkv demo

replay: $(EXT)
	$(PY) -m radixkv replay benches/data/mooncake_conversation_trace.jsonl.gz

# Everything it runs comes with the toolchain (clippy, rustfmt) or requirements-dev.txt (ruff,
# mypy); stubtest imports the built extension. One clippy pass covers the core, its tests and
# benches, and the PyO3 glue (the `python` feature only adds a module).
lint: $(EXT)
	cargo fmt --check
	cargo clippy --all-targets --features python -- -D warnings
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
