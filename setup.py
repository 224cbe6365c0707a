"""Package discovery: the repository's top-level folders are the rooms of one package, ``kvfuzz``.

    api/         -> kvfuzz              (__version__ and the public API)
    contracts/   -> kvfuzz.contracts
    strategies/  -> kvfuzz.strategies
    fuzz/        -> kvfuzz.fuzz         (and every subpackage under it: cli, bench, campaign, ...)

Every folder with an ``__init__.py`` under the three roots is found, so a new subpackage cannot be left out
(tests/test_layers.py checks the installed list against the tree). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = ("contracts", "strategies", "fuzz")

setup(
    packages=["kvfuzz"] + [f"kvfuzz.{p}" for p in find_packages(include=[f"{r}*" for r in ROOTS])
                           if p.split(".")[0] in ROOTS] + ["kvfuzz.fuzz.bench.bugs.patches"],
    package_dir={"kvfuzz": "api", **{f"kvfuzz.{r}": r for r in ROOTS}},
    # the re-injected upstream bugs of kvfuzz bench bugs (fuzz/bench/bugs/patches/): unified diffs read at run time,
    # a folder of data that setuptools packages as one of its own (listed, or it warns that it would be ignored)
    package_data={"kvfuzz.fuzz.bench.bugs.patches": ["*.patch"]},
)
