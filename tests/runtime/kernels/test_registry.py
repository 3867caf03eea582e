import ast
import dataclasses
from pathlib import Path

import pytest

import adapt.runtime.kernels as kernels_pkg
from adapt.runtime.kernels import IMPLS, get_kernels

ALLOWED_IMPORTS = {"torch", "math", "typing", "collections", "dataclasses", "functools", "__future__"}  # __future__: a compiler directive


def test_get_kernels_both_impls():
    adapt, ref = get_kernels("adapt"), get_kernels()
    assert ref == adapt and adapt.impl == "adapt"
    reference = get_kernels("reference")
    assert reference.impl == "reference"
    for field in dataclasses.fields(adapt):
        if field.name in ("impl", "backends"):
            continue
        k, r = getattr(adapt, field.name), getattr(reference, field.name)
        assert callable(k) and callable(r)
        assert r.__name__ in (k.__name__, k.__name__ + "_ref"), field.name
    assert reference.varlen_attention.__name__ == "varlen_attention_ref"
    assert IMPLS == ("adapt", "reference")


def test_unknown_impl():
    with pytest.raises(ValueError, match="reference"):
        get_kernels("triton")


def test_kernel_files_import_only_torch():
    for path in Path(kernels_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level > 0 else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= ALLOWED_IMPORTS, f"{path.name} imports {roots - ALLOWED_IMPORTS}"


def test_kernel_files_are_small():
    for path in Path(kernels_pkg.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) < 300, path.name
