"""Byte sizes as users type them, shared by shard (--max-file-size, --memory-budget) and run (--kv-cache-memory)."""

from __future__ import annotations

import pytest

from adapt.units import parse_bytes, size_number


@pytest.mark.parametrize("text,n", [("5GB", 5 * 10**9), ("500MiB", 500 << 20), ("20KB", 20_000), ("20kb", 20_000),
                                    ("2g", 2 << 30), ("1.5 GiB", 3 << 29), ("1000000", 10**6), (4096, 4096),
                                    ("7b", 7), ("1TB", 10**12), ("1tib", 1 << 40)])
def test_sizes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "GB", "lots", "0", "-2GB", "0.5B", "infGB", "nan", "1e400GB", "5XB", "5 G B x",
                                  float("nan"), float("inf"), -1])
def test_not_sizes(text):
    assert parse_bytes(text) is None


def test_size_number_keeps_the_unit():
    assert size_number("0.5") == (0.5, "") and size_number("2GiB") == (2.0, "gib") and size_number("x") is None
