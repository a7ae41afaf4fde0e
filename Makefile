# tiacc-training: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMPS  := .stamps
# Python packages the build, tests, demo and benchmarks need (all from PyPI).
PY_DEPS := torch torchvision numpy pillow tqdm pytest pytest-timeout maturin ruff==0.17.6 tfrecord \
           accelerate pytorch-lightning transformers 'ray[train]'
DEMO_DIR ?= data/demo
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml

.PHONY: help setup build wheel demo demo-run gpu-kit gpu-decoders gpu-check test test-rust test-python test-compat test-torch-leg torch-leg-venv test-torch-smoke bench bench-ddp bench-scaling bench-step-profile bench-amp bench-nccl bench-topk bench-collectives bench-horovod bench-fsdp bench-fsdp-rates lint docs-check fmt fuzz fuzz-merge clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	@# cmake and nasm build libjpeg-turbo (the image decoder); mpirun (openmpi-bin)
	@# launches the mpirun test; ip and tc (iproute2) build the benchmark cluster;
	@# sshd and ssh (openssh-server) carry the two-host test's remote ranks.
	@missing=""; for pair in cmake:cmake nasm:nasm mpirun:openmpi-bin ip:iproute2 tc:iproute2 \
	  /usr/sbin/sshd:openssh-server ssh:openssh-client; do \
	  command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

$(STAMPS)/venv: Makefile | $(STAMPS)/apt
	@mkdir -p $(STAMPS)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PY_DEPS)
	@touch $@

$(STAMPS)/build: $(STAMPS)/venv $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q
	@touch $@

setup: $(STAMPS)/build ## create .venv, install dependencies, build + install the extension (release)

build: setup ## alias of setup

wheel: $(STAMPS)/venv ## build the abi3 wheel (release) into dist/
	$(VENV)/bin/maturin build --release -q -o dist

# The torch range we claim, in four legs: the oldest release with the
# torchvision made for it (and numpy 1, which it was built against), one in
# the middle, 2.11 (what current CUDA 13 GPU images ship) and the newest on
# PyPI. `make test-compat` runs every leg in full, each in a fresh venv under
# .compat/ with the built wheel; CI runs the 2.11 leg from the source tree
# (`make test-torch-leg LEG=2.11`) next to `make test` on the newest.
TORCH_LEGS ?= 2.0 2.6 2.11 newest
TORCH_LEG_2.0 ?= torch==2.0.1 torchvision==0.15.2 numpy<2 accelerate<0.30
TORCH_LEG_2.6 ?= torch==2.6.0 torchvision==0.21.0
TORCH_LEG_2.11 ?= torch==2.11.0 torchvision==0.26.0
TORCH_LEG_newest ?= torch torchvision numpy
# The frameworks the user-script tests train with (pip picks the releases
# that go with each leg's torch, except where a release claims a torch it
# does not run on: Accelerate 0.30 and later call torch.cpu.device_count,
# which torch 2.0 lacks).
LEG_EXTRAS := accelerate pytorch-lightning
# What a leg runs: the user scripts, the "tiacc" backend's collectives, the
# DDP engine, init, and the Horovod API.
LEG_TESTS ?= tests/distributed/test_user_scripts.py tests/distributed/test_collectives.py \
             tests/distributed/test_ddp_engine.py tests/distributed/test_init.py \
             tests/distributed/test_horovod_ops.py tests/distributed/test_horovod_training.py \
             tests/distributed/test_horovod_elastic.py
COMPAT_TESTS ?= tests/unit $(LEG_TESTS)
LEG ?= 2.11

demo: setup ## generate + pack a dataset, then train a CNN with 2 ranks (tiacc vs stock PyTorch)
	$(MAKE) --no-print-directory demo-run

demo-run: ## the demo's two scripts with $(PY), no setup (PY=python3 on a machine without a venv)
	$(PY) demo/pack_demo.py --workdir $(DEMO_DIR)
	$(PY) demo/pytorch_native_ddp_demo.py --workdir $(DEMO_DIR) --compare

# The GPU check (tools/gpu_check.py) runs on a GPU machine without network
# access: make wheel and make gpu-kit here, bring the checkout with dist/ and
# .gpu-kit/ there, then make gpu-check (its own Python, OUT=, STAGE=, BUDGET=,
# NCCL_LIBRARY=). STAGE=plan (default) fits a short window; STAGE=all is the long check.
GPU_PY ?= python3
OUT ?= gpu-check-out
STAGE ?= plan
BUDGET ?= 420
gpu-kit: $(STAMPS)/venv ## the wheel (with the GPU tests' NCCL communicator) plus the small wheels a GPU machine may lack (.gpu-kit/wheels)
	@# The GPU tests drive one NCCL communicator from Python (test_nccl_init_bound):
	@# the kit's wheel has that test-only class; the shipped wheel (make wheel) does not.
	$(VENV)/bin/maturin build --release -q -o dist --features nccl-communicator
	@mkdir -p .gpu-kit/wheels
	$(PIP) download -q --no-deps --only-binary=:all: -d .gpu-kit/wheels pytest-timeout pyroute2 py-spy

gpu-decoders: ## the optional GPU JPEG decoder's wheels for a CUDA 13 GPU machine (.gpu-decoders, ~30 MB: carry it apart)
	@mkdir -p .gpu-decoders
	$(PIP) download -q --no-deps --only-binary=:all: -d .gpu-decoders nvidia-nvimgcodec-cu13 'nvidia-nvjpeg>=13,<14'

gpu-check: ## on a GPU machine: install the wheel, GPU tests, NCCL + input benchmarks, summary.md in OUT
	$(GPU_PY) tools/gpu_check.py --python $(GPU_PY) --out $(OUT) --stage $(STAGE) --budget $(BUDGET) \
	  $(if $(NCCL_LIBRARY),--nccl-library $(NCCL_LIBRARY))

test: setup test-rust test-python ## run every test (cargo test + pytest)

# The NCCL loader tests are #[ignore]d (a plain cargo test lists them as not
# run); they run here with the library of the venv's nvidia-nccl wheel, or the
# file TIACC_TEST_NCCL_LIBRARY names. TIACC_TEST_REQUIRE_NCCL=1 (CI) fails
# when there is none.
test-rust: ## cargo test of the engine (and its NCCL loader tests where a library is found)
	cargo test --workspace --exclude tiacc-py --quiet
	@lib="$${TIACC_TEST_NCCL_LIBRARY:-$$(ls $(VENV)/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1)}"; \
	if [ -n "$$lib" ] && [ -f "$$lib" ]; then \
	  echo "NCCL loader tests with $$lib"; \
	  TIACC_TEST_NCCL_LIBRARY="$$(realpath "$$lib")" cargo test -p tiacc-core --quiet nccl:: -- --ignored; \
	elif [ "$${TIACC_TEST_REQUIRE_NCCL:-0}" = 1 ]; then \
	  echo "TIACC_TEST_REQUIRE_NCCL=1 but no libnccl.so.2 in $(VENV) and no TIACC_TEST_NCCL_LIBRARY" >&2; exit 1; \
	else \
	  echo "NCCL loader tests not run: no libnccl.so.2 in $(VENV) (set TIACC_TEST_NCCL_LIBRARY)"; \
	fi

test-python: setup ## pytest (then the backend's collective tests again with its older form forced)
	$(PY) -m pytest tests -q --durations=10
	TIACC_TEST_BACKEND_FORM=process-group $(PY) -m pytest tests/distributed/test_collectives.py -q

test-compat: wheel ## every torch leg (TORCH_LEGS) in a fresh venv with the built wheel: unit, user-script, backend, DDP, Horovod tests
	@wheel=$$(ls -t dist/tiacc_training-*-abi3-*.whl | head -1); echo "testing $$wheel"; \
	$(foreach leg,$(TORCH_LEGS),tools/test_compat.sh torch-$(leg) "$$wheel" "$(TORCH_LEG_$(leg)) $(LEG_EXTRAS)" $(COMPAT_TESTS) && ) true

test-torch-leg: setup ## one torch leg from the source tree, e.g. make test-torch-leg LEG=2.11 (CI runs this one)
	tools/test_compat.sh torch-$(LEG) tree "$(TORCH_LEG_$(LEG)) $(LEG_EXTRAS)" $(LEG_TESTS)

torch-leg-venv: ## only make the venv of a torch leg (CI: while the build runs; then COMPAT_REUSE=1)
	COMPAT_SETUP_ONLY=1 tools/test_compat.sh torch-$(LEG) tree "$(TORCH_LEG_$(LEG)) $(LEG_EXTRAS)"

# Every minor torch release from 2.0 to the newest on PyPI, one after the
# other in a fresh venv (TORCH_SMOKE_RELEASES, SMOKE_WHEEL, SMOKE_DIR: see
# tools/torch_smoke.sh): the path the "tiacc" backend takes, an all_reduce and
# a DDP step; the table in docs/limits.md is rendered from the results.
test-torch-smoke: ## smoke-test the tiacc backend on every minor torch 2.x (fresh venvs); table into docs/limits.md
	tools/torch_smoke.sh; status=$$?; \
	$(or $(wildcard $(PY)),python3) tools/torch_table.py && exit $$status

bench: setup ## benchmarks (write benches/results/*.json)
	$(PY) benches/bench_pack.py
	$(PY) benches/bench_input.py  # also draws benches/results/bench_input.png

bench-ddp: setup ## DDP step time on an emulated 2-node cluster, native vs tiacc (needs root)
	$(PY) benches/bench_ddp.py
	$(PY) benches/plot_ddp.py

bench-scaling: setup ## ResNet-18 trained end to end on 2x2 ranks across link rates: examples/s, scaling efficiency (root)
	$(PY) benches/bench_scaling.py
	$(PY) benches/plot_scaling.py

bench-step-profile: setup ## where a DDP step's time goes, native vs tiacc, 2 ranks on this host (torch profiler)
	$(PY) benches/bench_step_profile.py

bench-amp: setup ## adaptive mixed precision: ResNet-18 fp32 vs AMP vs the policy (3 schedules), accuracy + images/s, fp16 stress case
	$(PY) benches/bench_amp.py --stress
	$(PY) benches/plot_amp.py

bench-nccl: setup ## DDP on CUDA: world-of-one overhead, GPU codecs, 2-node cluster on one GPU (root, NCCL >= 2.30)
	$(PY) benches/bench_nccl.py

bench-collectives: setup ## all_reduce 4 KB..256 MB through the tiacc backend vs gloo, 2 and 4 ranks on this host
	$(PY) benches/bench_collectives.py

bench-horovod: setup ## Horovod-style ResNet-50 images/s: hvd.DistributedOptimizer vs native DDP vs tiacc DDP, 2 and 4 ranks, slow link (root)
	$(PY) benches/bench_horovod.py

bench-fsdp: setup ## FSDP2 training step: tiacc (flat, 2D, 2D + bf16 reduce-scatter) vs gloo, 2x2 slow link and 4 ranks on one host (root)
	$(PY) benches/bench_fsdp.py

FSDP_RATES ?= 200 1000 3000 10000
bench-fsdp-rates: setup ## FSDP2 on a GPT-2-small-shaped decoder (4 blocks) at each of FSDP_RATES Mbit/s, 2x2 ranks: bench_fsdp_decoder_<rate>.json (root)
	for rate in $(FSDP_RATES); do \
	  $(PY) benches/bench_fsdp.py --model decoder --layers 4 --seq 64 --batch 2 --layouts link2x2 \
	    --rate-mbit $$rate --out benches/results/bench_fsdp_decoder_$$rate.json || exit 1; \
	done

bench-topk: setup ## Top-K with momentum SGD: held-out loss of native, Top-K, Top-K + momentum correction (4 CPU ranks)
	$(PY) benches/bench_topk_convergence.py

lint: setup ## rustfmt, clippy -D warnings, ruff, the extension's stub against the bindings
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/gen_stub.py --check
	$(PY) -m pytest -q tests/unit/test_layout.py

docs-check: ## every figure in README.md and docs/performance.md against its benches/results file
	$(or $(wildcard $(PY)),python3) tools/docs_numbers.py --check

fmt: setup ## format Rust and Python sources
	cargo fmt --all
	$(VENV)/bin/ruff format .

fuzz: ## run the cargo-fuzz targets on fuzz/corpus (FUZZ_SECONDS per target, default 600; CI: 30)
	bash fuzz/run.sh $(or $(FUZZ_SECONDS),600)

fuzz-merge: ## add the inputs that fuzz runs found (fuzz/new-corpus) to the checked-in corpus
	bash fuzz/run.sh merge

clean: ## remove build outputs (keeps .venv)
	cargo clean
	rm -rf $(STAMPS) .compat dist tiacc_training/_engine*.so
