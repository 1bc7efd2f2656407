"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import glasslm

# walk_packages: the core's modules live in the glasslm.core subpackage.
MODULES = sorted(m.name for m in pkgutil.walk_packages(glasslm.__path__, "glasslm."))
# Examples that take seconds (lm-eval loads every task definition it has): run by CI, not the inner loop.
SLOW_EXAMPLES = {"glasslm.evaluation.harness"}


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_EXAMPLES else m for m in MODULES])
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as err:  # a module behind an optional extra that is not installed
        pytest.skip(f"{name} needs an optional dependency: {err}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
