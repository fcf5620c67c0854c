"""Fixtures of the reliability suite; its figures are printed in the run's summary."""

from __future__ import annotations

from typing import Any

import pytest
from figures import FIGURES


@pytest.fixture(scope="session")
def report() -> dict[str, Any]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for key, value in FIGURES.items():
        terminalreporter.write_line(f"{key}: {value}")
