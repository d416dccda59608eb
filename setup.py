"""Package discovery for the one installed namespace, `mergebroker.*`, built from the repository's folders.

The ground layer (`core/`) is the `mergebroker` package itself and each layer above it is a sub-package
installed from its own top-level folder. Sub-packages are found by walking each folder, never listed by
hand, so a new folder cannot be left out of the wheel. (`bench/` and `tests/` are not installed.)
"""

from setuptools import find_packages, setup

LAYERS = {
    "mergebroker": "core",
    "mergebroker.merge": "merge",
    "mergebroker.breaker": "breaker",
    "mergebroker.providers": "providers",
    "mergebroker.broker": "broker",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in LAYERS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
