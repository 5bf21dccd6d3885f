"""Shared fixtures. Multi-process tests use tests/harness.py (real gloo, real store)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Text output is fitted to $COLUMNS (distdiag/report/render.py terminal_width): one width for
# every test, whatever the terminal or pytest-xdist's workers say (they said 80: the 1,024-rank
# report then wrapped past its line budget). A test that checks the fitting sets its own.
os.environ["COLUMNS"] = "120"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh directory the ranks run in (the report lands here)."""
    return tmp_path


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for subprocess CLI runs: this checkout first on the path, one thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("DISTDIAG_INJECT", None)
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
