"""Metadata, console scripts and pytest configuration live in pyproject.toml; this file only maps the
repository's folders to installed package names and keeps the repository's tooling out of the wheel.

The checkout keeps its top-level folders ``trainer/`` and ``bench/``; installed, they become
``fastmoe_trainer`` and ``fastmoe_bench`` so that no module named ``trainer`` or ``bench`` lands in
site-packages, where it would shadow (or be shadowed by) anything else of that name. The packages are
found here rather than listed in pyproject.toml because a static list would go stale whenever a
subpackage is added.

The wheel carries the library only. The tooling below runs from the checkout (``python -m
fastmoe_xpu.demo``, ``python -m fastmoe_xpu.tools.<name>``, the tests) and nothing in the library
imports it: an editable install (``pip install -e .``, scripts/setup_venv.sh) maps each top-level
folder whole, so it still sees every file; built wheels and sdists leave these out.
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# installed name -> folder in the repository
PACKAGE_DIRS = {"fastmoe_xpu": "fastmoe_xpu", "fastmoe_trainer": "trainer", "fastmoe_bench": "bench"}

#: Packages (with their subpackages) that stay in the repository: compile gates, GPU check kit,
#: xpu probe, families table generator.
CHECKOUT_ONLY_PACKAGES = ("fastmoe_xpu.tools",)
#: Single modules, as (package, module), that stay in the repository: the demo and the plain-PyTorch
#: references the tests compare with. (fastmoe_xpu.dist.testing stays in the wheel:
#: fastmoe_xpu.dist.comm_bytes and fastmoe_bench.studies.table3.table start their gloo processes with it.)
CHECKOUT_ONLY_MODULES = (("fastmoe_xpu", "demo"), ("fastmoe_xpu", "reference"))


def _checkout_only_package(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in CHECKOUT_ONLY_PACKAGES)


def _packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIRS.items():
        for pkg in find_packages(include=[folder, f"{folder}.*"]):
            installed = name + pkg[len(folder):]
            if not _checkout_only_package(installed):
                found.append(installed)
    return found


class LibraryBuildPy(build_py):
    """build_py without the checkout-only modules, and without their copies that an earlier build
    left in the build directory (pip builds in the source tree, and the wheel takes all of
    ``build/lib``)."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir)
                if (m[0], m[1]) not in CHECKOUT_ONLY_MODULES]

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for package, module in CHECKOUT_ONLY_MODULES:
            stale = os.path.join(self.build_lib, *package.split("."), module + ".py")
            if os.path.isfile(stale):
                os.remove(stale)
        for package in CHECKOUT_ONLY_PACKAGES:
            stale = os.path.join(self.build_lib, *package.split("."))
            if os.path.isdir(stale):
                shutil.rmtree(stale)


#: Data files the library reads: the kept Triton config tables (``fastmoe_xpu/kernels/kept_configs.py``),
#: one JSON file per device written by ``python -m fastmoe_xpu.tools.config_sweep``; the step-time model's
#: cluster files (``trainer/scale/clusters/*.toml``, read through importlib.resources).
PACKAGE_DATA = {"fastmoe_xpu.kernels": ["tuned/*.json"], "fastmoe_trainer.scale": ["clusters/*.toml"]}

setup(packages=_packages(), package_dir=PACKAGE_DIRS, package_data=PACKAGE_DATA, cmdclass={"build_py": LibraryBuildPy})
