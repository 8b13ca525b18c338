"""Package discovery that pyproject.toml cannot express: two top-level folders installed under physics_dp.

models/ becomes physics_dp.models and configs/ becomes physics_dp.configs, so no top-level
``models`` package is installed to clash with users' own ``models.py``.
"""

from setuptools import find_packages, setup

MAPPED = {"physics_dp.models": "models", "physics_dp.configs": "configs"}

packages = find_packages(include=["physics_dp", "physics_dp.*"])
for package, folder in MAPPED.items():
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(where=folder)]

setup(packages=packages, package_dir={"physics_dp": "physics_dp", **MAPPED})
