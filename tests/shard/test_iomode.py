"""How a shard run's large files reach the device (adapt/shard/iomode.py): the O_DIRECT probe, what it decides,
what ADAPT_SHARD_DIRECT forces, and what the run's summary says."""

from __future__ import annotations

import json
import os

import pytest

from adapt.errors import ShardError
from adapt.shard import iomode, writer
from adapt.shard.run import shard


@pytest.fixture()
def auto(monkeypatch):
    monkeypatch.delenv(iomode.ENV, raising=False)
    monkeypatch.setattr(writer, "DIRECT", True)


def test_the_probe_times_real_direct_writes_and_leaves_nothing(tmp_path):
    rate = iomode.probe(tmp_path, nbytes=4 << 20, piece=1 << 20)
    # None only where this filesystem refuses O_DIRECT (tmpfs); otherwise bytes per second of real writes
    assert rate is None or 1e6 < rate < 1e12
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_that_refuses_direct_io_probes_as_none(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(iomode.os, "open", no_direct)
    assert iomode.probe(tmp_path) is None and list(tmp_path.iterdir()) == []

    def einval_write(fd, view, offset):  # the flag taken, the I/O refused (some FUSE filesystems)
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(iomode.os, "open", real_open)
    monkeypatch.setattr(writer, "pwrite_all", einval_write)
    assert iomode.probe(tmp_path) is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rate,direct", [(2.1e9, True), (1e9, True), (0.41e9, False), (None, False)])
def test_direct_only_where_the_device_is_fast(auto, tmp_path, monkeypatch, rate, direct):
    monkeypatch.setattr(iomode, "probe", lambda out: rate)
    got, why = iomode.direct_io(tmp_path, writer.DIRECT_MIN)
    assert got is direct
    assert why.startswith("O_DIRECT" if direct else "page cache")
    assert ("refuses" in why) if rate is None else f"{rate / 1e9:.2f} GB/s" in why


def test_small_files_and_forced_modes_do_not_probe(auto, tmp_path, monkeypatch):
    def boom(out):
        raise AssertionError("probed")
    monkeypatch.setattr(iomode, "probe", boom)
    assert iomode.direct_io(tmp_path, writer.DIRECT_MIN - 1) == (False, "page cache (small files)")
    for mode, want in (("1", True), ("0", False)):
        monkeypatch.setenv(iomode.ENV, mode)
        assert iomode.direct_io(tmp_path, 1 << 40)[0] is want
    monkeypatch.setattr(writer, "DIRECT", False)  # a filesystem refused O_DIRECT earlier in this process
    monkeypatch.setenv(iomode.ENV, "1")
    assert iomode.direct_io(tmp_path, 1 << 40)[0] is False


def test_a_bad_setting_is_an_error_before_out_is_touched(tiny_ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv(iomode.ENV, "yes")
    with pytest.raises(ShardError, match="ADAPT_SHARD_DIRECT must be 0, 1 or auto"):
        shard(tiny_ckpts["llama"], tmp_path / "o", tp=2)
    assert not (tmp_path / "o").exists()


def test_the_summary_says_how_files_were_written(auto, tiny_ckpts, tmp_path, monkeypatch, capsys):
    from adapt.cli.main import main

    monkeypatch.setattr(writer, "DIRECT_MIN", 0)  # the tiny files count as large: the run probes
    monkeypatch.setattr(iomode, "probe", lambda out: 0.3e9)
    try:
        main(["shard", str(tiny_ckpts["llama"]), "--out", str(tmp_path / "o"), "--tp", "2", "--format", "json"])
    except SystemExit as e:
        assert not e.code
    assert json.loads(capsys.readouterr().out)["io"] == "page cache (O_DIRECT probe 0.30 GB/s)"
