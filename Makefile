# Two commands for a fresh clone: `make test` and `make demo`. Each installs what it needs
# into a local venv first (vllm==0.26.0 brings torch 2.11.0 and Triton 3.6.0).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed

.PHONY: test test-fast demo csrc gpu-bundle gpu-models clean

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
# .gpu/pyextra: hypothesis for the property tests on the GPU host, which lacks it. Its wheel has a
# native part, so it is the host's build (CPython 3.12, x86_64) of the version CI uses. pytest-xdist
# (pure Python) runs the attention GPU tests in parallel: their float64 references run on the CPU.
HOST_PY := 3.12
XDIST_VERSION := 3.8.0
EXECNET_VERSION := 2.1.2
gpu-bundle: $(STAMP)
	bash ../shared/gpu/make-bundle.sh .gpu
	# part1 (59.6 MiB) plus the tracked tree passed the 64 MiB a call carries (session 11):
	# the CUTLASS wheel travels alone in .gpu/part1w (docs/GPU_HOST.md, call 1b)
	rm -rf .gpu/part1w && mkdir -p .gpu/part1w && mv .gpu/part1/wheels .gpu/part1w/
	# part2 plus the tree reached 64 MiB in session 18: part2's two largest wheels go to part1w too
	mv .gpu/part2/wheels/pycountry-*.whl .gpu/part2/wheels/mistral_common-*.whl .gpu/part1w/wheels/
	# part1's C.so.xz (55.9 MB) plus the tree (11.4 MB) passed 64 MiB in session 20: its tail goes to
	# part1w too, and call 1b (scripts/gpu_part1w.sh) joins the two pieces on the host
	split -b 48M .gpu/part1/C.so.xz .gpu/part1/C.so.xz. && rm .gpu/part1/C.so.xz
	for f in .gpu/part1/C.so.xz.a?; do [ "$$f" = .gpu/part1/C.so.xz.aa ] || mv "$$f" .gpu/part1w/; done
	rm -rf .gpu/pyextra .gpu/pyextra-wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(HOST_PY) \
	  --platform manylinux_2_17_x86_64 -d .gpu/pyextra-wheels sortedcontainers \
	  pytest-xdist==$(XDIST_VERSION) execnet==$(EXECNET_VERSION) "hypothesis==$$($(PY) -c 'import hypothesis; print(hypothesis.__version__)')"
	for w in .gpu/pyextra-wheels/*.whl; do $(PY) -m zipfile -e "$$w" .gpu/pyextra; done
	rm -rf .gpu/pyextra-wheels

# The real SmolLM2-135M (bf16, rebuilt from the blocks of the GGUF it was converted from), the
# `make demo` W4A8+KV8 checkpoint (its embedding shared with bf16) and the eval texts, packed into
# parts of <= 48 MiB for the offline GPU host (a call carries the tree too, 8 MiB and growing, within
# 64 MiB: 60 MiB parts stopped fitting in session 17): scripts/gpu_models.sh says how they travel there.
CACHE ?= $(or $(VLLM_MIXPREC_CACHE),$(HOME)/.cache/vllm_mixprec)
# QWEN=1 adds the real Qwen2.5-Coder-1.5B (its 1,060 MiB of GGUF blocks: ~25 more parts);
# QWEN=only packs the texts and Qwen without SmolLM2 (the qwen-* arms; ~25 parts of 44 MiB).
QWEN ?= 0
QWEN_ITEMS := $(if $(filter 1 only,$(QWEN)),--item models/qwen2.5-coder-1.5b=$(CACHE)/models/qwen2.5-coder-1.5b \
  --gguf models/qwen2.5-coder-1.5b=$(CACHE)/gguf/qwen2.5-coder-1.5b.gguf)
SMOL_ITEMS := $(if $(filter only,$(QWEN)),,--item models/smollm2-135m=$(CACHE)/models/smollm2-135m \
  --gguf models/smollm2-135m=$(CACHE)/gguf/smollm2-135m.gguf --item demo-smollm2-w4a8-kv8=$(CACHE)/demo-smollm2-w4a8-kv8)
gpu-models: $(STAMP)
	@test "$(QWEN)" = only || test -f $(CACHE)/demo-smollm2-w4a8-kv8/config.json || { echo "no demo checkpoint in $(CACHE): run make demo first"; exit 1; }
	$(PY) -c "from vllm_mixprec.quantize import models as m; $(if $(filter only,$(QWEN)),,m.fetch_gguf('smollm2-135m');) [m.fetch_text(t) for t in (*m.EVAL_TEXTS, 'alice29')]"
	$(if $(filter 1 only,$(QWEN)),$(PY) -c "from vllm_mixprec.quantize import models as m; m.fetch_model('qwen2.5-coder-1.5b')")
	$(PY) -m vllm_mixprec.eval.modelpack pack --out .gpu/models --part-mib 44 \
	  --item text/lcet10.txt=$(CACHE)/text/lcet10.txt --item text/botchan.txt=$(CACHE)/text/botchan.txt \
	  --item text/alice29.txt=$(CACHE)/text/alice29.txt \
	  $(SMOL_ITEMS) $(QWEN_ITEMS)

clean:
	rm -rf build vllm_mixprec/_C*.so
