# Two commands for a newcomer: `make demo` and `make test`. Each sets up what it needs.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
AZURITE := .cache/azurite/node_modules/.bin/azurite

.PHONY: demo test test-unit bench clean install

$(PY):
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) requirements-dev.txt pyproject.toml
	$(PIP) install -q -r requirements-dev.txt
	DS_BUILD_SHM_COMM=1 $(PIP) install -q --no-build-isolation --no-cache-dir deepspeed==0.19.8
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

$(AZURITE):
	mkdir -p .cache/azurite
	cd .cache/azurite && npm install --no-audit --no-fund --silent azurite@3.35.0

install: $(STAMP) $(AZURITE)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) $(AZURITE)
	$(PY) -m pytest -q -ra --durations=15 tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

bench: $(STAMP) $(AZURITE)
	$(PY) benchmarks/recovery.py --hidden 1536 --layers 5
	$(PY) benchmarks/steady_state.py
	$(PY) benchmarks/snapshot_overhead.py
	$(PY) benchmarks/data_overhead.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/control_plane.py --repeats 1
	$(PY) benchmarks/chaos.py
	$(PY) benchmarks/ray_data_input.py
	$(PY) benchmarks/sharded_recovery.py --kill-at 5 --between 2 --checkpoint-every 3 --timeout-s 150
	$(PY) benchmarks/spot_economics.py

clean:
	rm -rf .venv .cache
