"""Every module under loadtest/, its subpackages included, imports: ``make bench`` runs its parts one after another,
so a name one of them imports from another that has moved stops the whole suite at that part (part 12 did, after
``_stats`` moved to the embedded server's ``table_stats``)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import loadtest

MODULES = sorted(m.name for m in pkgutil.walk_packages(loadtest.__path__, "loadtest."))


@pytest.mark.parametrize("name", MODULES)
def test_the_benchmark_module_imports(name: str) -> None:
    importlib.import_module(name)
