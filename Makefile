# Two entry points that do all the set-up on a fresh machine:
#   make run    the main job on a small embedded default
#   make test   the test suite
PY := .venv/bin/python

.PHONY: venv run demo test bench

venv:
	bash scripts/setup_venv.sh

run: demo

demo: venv
	$(PY) -m fastmoe_xpu.demo

test: venv
	$(PY) -m pytest -q tests

bench: venv
	$(PY) -m bench --preset tiny
