"""The kernel's cap on the HTTP listen backlog is read (Linux /proc, macOS sysctl) and a cap below
the backlog asked for is one warning with the command that raises it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tokenizer_proc import backlog


def fake_sysctl(tmp_path: Path, body: str) -> tuple[str, ...]:
    path = tmp_path / "sysctl"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return (str(path), "-n", "kern.ipc.somaxconn")


@pytest.mark.timeout(10)
def test_linux_reads_proc(tmp_path, monkeypatch):
    monkeypatch.setattr(backlog, "PROC_PATH", tmp_path / "somaxconn")
    (tmp_path / "somaxconn").write_text("4096\n")
    assert backlog.listen_cap("linux") == 4096


@pytest.mark.timeout(10)
def test_darwin_asks_sysctl(tmp_path, monkeypatch):
    monkeypatch.setattr(backlog, "SYSCTL", fake_sysctl(tmp_path, "echo 128\n"))
    assert backlog.listen_cap("darwin") == 128


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "body",
    ["exit 1\n", "echo not-a-number\n", "exec sleep 30\n"],
    ids=["fails", "garbage", "hangs"],
)
def test_darwin_failures_are_ignored(tmp_path, monkeypatch, body):
    monkeypatch.setattr(backlog, "SYSCTL", fake_sysctl(tmp_path, body))
    monkeypatch.setattr(backlog, "SYSCTL_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    assert backlog.listen_cap("darwin") is None
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(10)
def test_missing_sources_are_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr(backlog, "PROC_PATH", tmp_path / "absent")
    monkeypatch.setattr(backlog, "SYSCTL", (str(tmp_path / "absent"), "-n", "x"))
    assert backlog.listen_cap("linux") is None
    assert backlog.listen_cap("darwin") is None
    assert backlog.listen_cap("win32") is None


@pytest.mark.timeout(10)
def test_a_cap_below_the_backlog_is_one_warning_with_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(backlog, "SYSCTL", fake_sysctl(tmp_path, "echo 128\n"))
    with caplog.at_level(logging.WARNING, logger="tokenizer.http"):
        assert backlog.warn_if_capped(1024, "darwin") == 128
    [record] = caplog.records
    assert "128" in record.message and "sudo sysctl -w kern.ipc.somaxconn=1024" in record.message


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cap", ["1024", "4096", ""], ids=["equal", "above", "unreadable"])
def test_no_warning_when_the_kernel_grants_the_backlog(tmp_path, monkeypatch, caplog, cap):
    monkeypatch.setattr(backlog, "PROC_PATH", tmp_path / "somaxconn")
    (tmp_path / "somaxconn").write_text(cap)
    with caplog.at_level(logging.WARNING, logger="tokenizer.http"):
        granted = backlog.warn_if_capped(1024, "linux")
    assert granted == 1024 and caplog.records == []


@pytest.mark.timeout(10)
def test_linux_warning_names_its_sysctl(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(backlog, "PROC_PATH", tmp_path / "somaxconn")
    (tmp_path / "somaxconn").write_text("128\n")
    with caplog.at_level(logging.WARNING, logger="tokenizer.http"):
        backlog.warn_if_capped(1024, "linux")
    assert "sudo sysctl -w net.core.somaxconn=1024" in caplog.text
