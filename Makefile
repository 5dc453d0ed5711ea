# Set-up and the two commands of the README. Override TORCH to bring your own build, e.g.
#   make demo TORCH='torch --index-url https://download.pytorch.org/whl/cu128'
# A torch already importable in the venv is kept as it is.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
OUT ?= out

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/duoserve-trace collect --out $(OUT)/traces
	$(VENV)/bin/duoserve-trace info $(OUT)/traces

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/trace_overhead.py

clean:
	rm -rf $(OUT)
