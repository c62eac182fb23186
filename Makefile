# megagspo: every target installs what it needs, by dependency, into $(VENV).
#   make train       the main job: GSPO on a tiny Qwen3-MoE, CPU, embedded defaults
#   make train-tools the tool-use main job: multi-turn trajectories with an add tool (configs/tiny_tools_cpu.yaml)
#   make test        install everything, then run the whole test suite
#   make ablate      routing-replay ablation v2: an fp8_sim engine against the fp32 trainer on a small MoE, 5 arms x
#                    4 settings x 3 seeds, report (ABLATION=configs/ablations/moe_volatile_cpu.yaml: v1, no engine gap)
#   make cuda-check  compile every csrc/**/*.cu for sm_90 with nvcc against torch's headers (no GPU needed)
#   make gpu-wheels  (any networked machine) the cp312 wheels an offline CUDA image with torch lacks, into .gpu-wheels/
#   make gpu-check   (the GPU host) install them offline, build the CUDA extension, run every GPU stage in 470 s;
#                    without CUDA: dry mode, the same table with SKIP reasons

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
PY := $(BIN)/python
# torch is installed first and pinned; on a GPU host set TORCH_SPEC to the CUDA build you use
# (or TORCH_SPEC= to keep a preinstalled one) and CONSTRAINTS= to drop the CPU pin.
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS ?= -c requirements/cpu-constraints.txt
# CPU hosts (CONSTRAINTS set) also get requirements/cpu-only.txt: triton for its interpreter, never a GPU's triton.
CPU_ONLY ?= $(if $(strip $(CONSTRAINTS)),-r requirements/cpu-only.txt)
# VENV_ARGS=--system-site-packages lets the venv see a CUDA torch preinstalled on a GPU host.
VENV_ARGS ?=
PYTEST_ARGS ?=
CUDA_ARCH ?= 90
NVCC ?= nvcc

INSTALLED := $(VENV)/.installed
EXT_STAMP := $(VENV)/.ext-built
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
CU_SOURCES := $(shell find csrc -name '*.cu' 2>/dev/null)

.PHONY: install ext train train-tools ablate smoke test test-fast cuda-check gpu-wheels gpu-check clean

install: $(INSTALLED) $(EXT_STAMP)

$(INSTALLED): requirements/base.txt requirements/cpu-constraints.txt requirements/cpu-only.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) install --disable-pip-version-check -q --upgrade pip setuptools wheel $(CONSTRAINTS)
	@if [ -n "$(TORCH_SPEC)" ]; then $(PIP) install --disable-pip-version-check -q "$(TORCH_SPEC)"; fi
	$(PIP) install --disable-pip-version-check -q $(CONSTRAINTS) -r requirements/base.txt $(CPU_ONLY)
	$(PY) -c "import torch, megatron.core, transformers; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)"
	touch $@

# The editable install builds megagspo._C in place; rebuilt whenever a csrc/ file changes.
$(EXT_STAMP): $(INSTALLED) $(CSRC)
	MEGAGSPO_NO_EXT=1 $(PIP) install --disable-pip-version-check -q $(CONSTRAINTS) --no-build-isolation --no-deps -e .
	$(PY) setup.py -q build_ext --inplace
	$(PY) -c "import torch, megagspo._C as C; print('megagspo._C built; CUDA kernels:', C.built_with_cuda())"
	touch $@

ext: $(EXT_STAMP)

train: install
	$(BIN)/megagspo train --config configs/tiny_cpu.yaml $(ARGS)

train-tools: install
	$(BIN)/megagspo train --config configs/tiny_tools_cpu.yaml $(ARGS)

# One run per core (the recipe's threads: 1); rerunning skips finished runs and resumes interrupted ones.
ABLATE_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
ABLATION ?= configs/ablations/moe_mismatch_cpu.yaml
ablate: install
	$(BIN)/megagspo ablate --config $(ABLATION) --jobs $(ABLATE_JOBS) $(ARGS)

smoke: install
	$(PY) -m moe.smoke

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

cuda-check: $(INSTALLED)
	@set -e; \
	if [ -z "$(CU_SOURCES)" ]; then echo "cuda-check: no .cu sources under csrc/"; exit 0; fi; \
	command -v $(NVCC) >/dev/null || { echo "cuda-check: nvcc not found"; exit 1; }; \
	mkdir -p .cuda-check; \
	inc=$$($(PY) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))"); \
	pyinc=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	abi=$$($(PY) -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"); \
	for f in $(CU_SOURCES); do \
	  echo "nvcc sm_$(CUDA_ARCH): $$f"; \
	  $(NVCC) -c $$f -o .cuda-check/$$(basename $$f).o -std=c++20 -O3 \
	    -gencode=arch=compute_$(CUDA_ARCH),code=sm_$(CUDA_ARCH) \
	    -Icsrc $$inc -I$$pyinc -DTORCH_EXTENSION_NAME=_C -DMEGAGSPO_WITH_CUDA=1 \
	    -D_GLIBCXX_USE_CXX11_ABI=$$abi -Xcompiler -fPIC --expt-relaxed-constexpr; \
	done; \
	echo "cuda-check: compiled $(words $(CU_SOURCES)) file(s) for sm_$(CUDA_ARCH)"

# Wheels for an offline GPU host whose image has Python 3.12 + a CUDA torch: downloaded here (no torch, no deps:
# the image has the rest), refused over 48 MiB (what travels with the repository is bounded). PEERS=1 adds the
# optional bench peers (Liger, Cut Cross-Entropy).
GPU_WHEELS ?= .gpu-wheels
GPU_WHEELS_MAX_MIB ?= 48
PEERS ?= 1
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d $(GPU_WHEELS) \
	  -r requirements/gpu-offline.txt $(if $(filter 1,$(PEERS)),-r requirements/gpu-peers.txt)
	@ls -l $(GPU_WHEELS) | awk 'NR > 1 {print "  " $$5 "  " $$9}'
	@bytes=$$(du -cb $(GPU_WHEELS)/*.whl | tail -1 | cut -f1); \
	echo "gpu-wheels: $$(ls $(GPU_WHEELS) | wc -l) wheels, $$bytes bytes in $(GPU_WHEELS)/"; \
	if [ $$bytes -gt $$(( $(GPU_WHEELS_MAX_MIB) * 1048576 )) ]; then \
	  echo "gpu-wheels: over $(GPU_WHEELS_MAX_MIB) MiB: refused"; rm -rf $(GPU_WHEELS); exit 1; fi

# No install step of its own: the script installs the wheels offline on the GPU host (see tools/gpu_check.sh).
gpu-check:
	bash tools/gpu_check.sh $(ARGS)

clean:
	rm -rf build .cuda-check megagspo/_C*.so *.egg-info
