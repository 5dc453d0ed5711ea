# Set-up and the two commands of the README.
# PyTorch: a torch already importable in the venv is kept as it is (bring your own: install it into .venv first,
# or say which, e.g. make demo TORCH='torch --index-url https://download.pytorch.org/whl/cu128'). Otherwise a
# machine with an NVIDIA driver gets PyPI's CUDA build, and any other the CPU build from PyTorch's CPU index
# (where that index cannot be reached, pip moves on to the package index and local wheels).
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_INDEX = https://download.pytorch.org/whl/cpu
# asked once, when set-up runs: can this machine reach PyTorch's CPU index (5 s at most)?
CPU_INDEX_REACHABLE = $(shell python3 -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/', timeout=5)" \
                        2>/dev/null && echo yes)
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,\
           torch==2.13.0 $(if $(CPU_INDEX_REACHABLE),--extra-index-url $(CPU_INDEX)))
OUT ?= out

.PHONY: setup setup-dev demo test bench clean

# what the pipeline needs; the test tools (pytest, ONNX export, the notebook kernel) only for make test
setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e .
	touch $@

# Triton for its interpreter alone (the GPU kernels' tests, on the CPU), in a folder of its own: the venv's torch
# never imports it (CUDA builds of torch bring their own)
TRITON_ASIDE = $(VENV)/triton-interpreter
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	$(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),$(PY) -m pip install -q --no-deps \
	  --target $(TRITON_ASIDE) "triton>=3.2" || echo "no Triton: the interpreter test of the GPU kernels will skip")
	touch $@

demo: setup
	$(VENV)/bin/duoserve-trace collect --out $(OUT)/traces
	$(VENV)/bin/duoserve-trace info $(OUT)/traces
	$(VENV)/bin/duoserve-eval health $(OUT)/traces
	$(VENV)/bin/duoserve-train stats $(OUT)/traces --out $(OUT)/stats.safetensors
	$(VENV)/bin/duoserve-train fit $(OUT)/traces --out $(OUT)/predictor --epochs 4 --clean
	$(VENV)/bin/duoserve-eval accuracy $(OUT)/traces --predictor $(OUT)/predictor --out $(OUT)/report
	$(VENV)/bin/duoserve-run generate --predictor $(OUT)/predictor --out $(OUT)/generate.json
	$(VENV)/bin/duoserve-run bench --predictor $(OUT)/predictor --predictor none --policy duoserve \
	    --policy on-demand --policy lru --policy all-resident --prompt-len 64 --new-tokens 16 --out $(OUT)/bench.json
	$(VENV)/bin/duoserve-eval simulate --profile h200-embedded --model-shape embedded --traces $(OUT)/traces \
	    --predictor $(OUT)/predictor --predictor none --requests 40 --out $(OUT)/sim

test: setup-dev
	$(PY) -m pytest -q

# the CPU benchmarks; each writes its latest result (with commit, machine and command) to benchmarks/results/
bench: setup-dev
	$(PY) benchmarks/trace_overhead.py --out benchmarks/results/trace_overhead_cpu.json
	$(PY) benchmarks/predictor_latency.py --iters 300 --out benchmarks/results/predictor_latency_cpu.json
	$(PY) benchmarks/stats_throughput.py --rows 400000 --rounds 3 --out benchmarks/results/stats_throughput_cpu.json
	$(PY) benchmarks/eval_throughput.py --out benchmarks/results/eval_throughput_cpu.json
	$(PY) benchmarks/import_throughput.py --out benchmarks/results/import_throughput_cpu.json
	$(PY) benchmarks/runtime_host_cpu.py --rounds 3 --new-tokens 32 --out benchmarks/results/runtime_host_cpu_cpu.json

clean:
	rm -rf $(OUT)
