# Two commands for a fresh clone: `make test` and `make demo`. Each installs what it needs
# into a local venv first (vllm==0.26.0 brings torch 2.11.0 and Triton 3.6.0).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed

.PHONY: test test-fast demo csrc gpu-bundle clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "vllm==0.26.0"
	MIXPREC_BUILD_CUDA=0 $(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

# Compiles csrc/ (sm80 + sm90a) in place; needs nvcc. CI runs it through `make test`,
# so a build break turns CI red. Nothing built here runs without a GPU.
csrc: $(STAMP)
	@if command -v nvcc >/dev/null; then \
	  MIXPREC_BUILD_CUDA=1 MAX_JOBS=$${MAX_JOBS:-2} $(PY) setup.py -q build_ext --inplace; \
	else echo "nvcc not found: skipping csrc/ (the package uses its Triton kernels)"; fi

test: $(STAMP) csrc
	$(PY) -m pytest -q tests

# The CPU suite without compiling csrc/
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -x

demo: $(STAMP)
	$(PY) -m vllm_mixprec.demo

# Packs vLLM for the offline GPU host (see scripts/gpu_check.sh)
# .gpu/pyextra: hypothesis (pure Python) for the property tests on the GPU host, which lacks it
gpu-bundle: $(STAMP)
	bash ../shared/gpu/make-bundle.sh .gpu
	rm -rf .gpu/pyextra && mkdir -p .gpu/pyextra
	$(PY) -c "import hypothesis, sortedcontainers, os; print(os.path.dirname(os.path.dirname(hypothesis.__file__)))" \
	  | xargs -I{} sh -c 'cd {} && cp -r hypothesis sortedcontainers _hypothesis_*.py hypothesis-*.dist-info sortedcontainers-*.dist-info $(CURDIR)/.gpu/pyextra/'
	find .gpu/pyextra -name __pycache__ -prune -exec rm -rf {} +

clean:
	rm -rf build vllm_mixprec/_C*.so
