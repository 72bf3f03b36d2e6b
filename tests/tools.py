"""Debian tools some tests drive (promtool, prometheus, kubectl)."""

import os
import shutil

import pytest


def need_tool(name: str, package: str | None = None) -> str:
    """The path of a tool the test needs. Where it is missing the test is skipped, except for the tools
    named in SLUICE_REQUIRE_TOOLS (.ci/run installs and names them): their absence fails."""
    path = shutil.which(name)
    if path is None:
        missing(name, f"{name} is not installed (apt-get install {package or name})")
    return path


def missing(name: str, reason: str):
    """Skip for `reason`, or fail where SLUICE_REQUIRE_TOOLS names `name`."""
    if name in os.environ.get("SLUICE_REQUIRE_TOOLS", "").split():
        pytest.fail(f"{reason}; .ci/run installs it")
    pytest.skip(reason)
