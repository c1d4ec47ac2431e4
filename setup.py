"""Metadata, console scripts and pytest configuration live in pyproject.toml; this file only maps the
repository's folders to installed package names.

The checkout keeps its top-level folders ``trainer/`` and ``bench/``; installed, they become
``fastmoe_trainer`` and ``fastmoe_bench`` so that no module named ``trainer`` or ``bench`` lands in
site-packages, where it would shadow (or be shadowed by) anything else of that name. The packages are
found here rather than listed in pyproject.toml because a static list would go stale whenever a
subpackage is added.
"""
from setuptools import find_packages, setup

# installed name -> folder in the repository
PACKAGE_DIRS = {"fastmoe_xpu": "fastmoe_xpu", "fastmoe_trainer": "trainer", "fastmoe_bench": "bench"}


def _packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIRS.items():
        for pkg in find_packages(include=[folder, f"{folder}.*"]):
            found.append(name + pkg[len(folder):])
    return found


setup(packages=_packages(), package_dir=PACKAGE_DIRS)
