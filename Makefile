# Entry points that do all the set-up on a fresh machine:
#   make run    the main job on a small embedded default
#   make demo   the drop-in check on a small model, then the first honest number: the Mula-7B-A1B layer
#               against transformers and its GEMM-only bound, the published figure beside (under a minute)
#   make test   the test suite (also builds .venv-xpu, Intel's Triton + ocloc, for the PVC compile gate)
#   make test-compat  the test suite (fault drills and PVC compiles aside) on the oldest versions supported
#               (torch 2.11.0, triton 3.6.0, transformers 5.17.0: the GPU machine image's), in .venv-compat;
#               make test-compat-ci: its version-sensitive part, which .ci/run runs
#   make gpu-check  on a machine with a CUDA or XPU device: device tests, bf16 benchmark of every engine,
#               sanitizers, one summary (scripts/gpu_check.sh; uses the Python found there, no venv step;
#               `bash scripts/gpu_check.sh` does the same where make is missing)
PY := .venv/bin/python
# Extra pytest arguments for make test, e.g. PYTEST_ARGS='-m "not drill"' (.ci/run splits the suite so).
PYTEST_ARGS :=
# What test-compat runs (docs/compat.md): the whole suite but the fault drills (minutes each; make test runs them)
# and the PVC compiles, which run in .venv-xpu whatever the suite's versions (make test runs them).
COMPAT_TESTS := -m "not drill and not xpu_venv" tests
# What make test-compat-ci (.ci/run; docs/compat.md, "In CI") leaves out of the suite above: the tests of
# the command lines' own front (options, config files, messages, output folders, leases, logging, docs, the
# bench's tables), which run the same Python code on any torch, triton and transformers; make test runs them.
COMPAT_FRONT := --ignore=tests/bench --ignore=tests/test_docs.py \
  --ignore=tests/test_docs_commands.py --ignore=tests/test_packaging.py \
  $(foreach f,config_file cli_first_use misuse installed run_lines owned_outputs command_stops trainer_config \
    schedules data mixture wandb_logging tensorboard_scalars,--ignore=tests/trainer/test_$(f).py) \
  --ignore=tests/trainer/ft/test_lease.py --ignore=tests/trainer/ft/test_fault_outputs.py

.PHONY: venv xpu-venv compat-venv run demo test test-compat test-compat-ci bench compile-check gpu-check

venv:
	bash scripts/setup_venv.sh

xpu-venv:
	bash scripts/setup_xpu_venv.sh

run: venv
	$(PY) -m trainer --preset tiny-moe --export-hf out/run/hf --eval.overwrite

demo: venv
	$(PY) -m fastmoe_xpu.demo --steps 3
	$(PY) -m bench --demo --out bench_out/demo

test: venv xpu-venv
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

compat-venv:
	bash scripts/setup_compat_venv.sh

test-compat: compat-venv
	.venv-compat/bin/python -m pytest -q -rs -p no:cacheprovider $(COMPAT_TESTS)

test-compat-ci: COMPAT_TESTS += $(COMPAT_FRONT)
test-compat-ci: test-compat

compile-check: venv xpu-venv
	$(PY) -m fastmoe_xpu.tools.compile_check --target all
	CC=g++ .venv-xpu/bin/python -m fastmoe_xpu.tools.compile_check --target xpu

bench: venv
	$(PY) -m bench --preset tiny

gpu-check:
	bash scripts/gpu_check.sh
