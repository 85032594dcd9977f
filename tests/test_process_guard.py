"""tests/process_guard.py run on test files made for the purpose (pytester, in this process):
a test not marked slow fails when it uses the session's server, when a session fixture it is
the first to need starts a process, and when it starts one itself (multiprocessing's spawn
included); a slow test and the kernels' compiler pass. Every way of starting a process is
replaced by a fake for the run, so nothing starts whatever the plugin does."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

CONFTEST = """
import subprocess, sys
from pathlib import Path
import pytest

pytest_plugins = ["process_guard"]

@pytest.fixture(scope="session")
def base_url():
    Path("server-started").write_text("yes")
    yield "http://127.0.0.1:1"

@pytest.fixture(scope="session")
def worker():
    subprocess.Popen([sys.executable, "-c", "pass"])
    yield
"""

TESTS = """
import multiprocessing, subprocess, sys
import pytest
from probserve.kernels.build import compiler

def test_uses_the_server(base_url):
    pass

def test_is_the_first_to_need_the_worker(worker):
    pass

def test_spawns_a_worker_of_its_own():
    multiprocessing.get_context("spawn").Process(target=print).start()

def test_names_the_kernels_compiler():
    with pytest.raises(OSError, match="a fake"):
        subprocess.run([compiler(), "--version"])

@pytest.mark.slow
def test_slow_starts_one():
    with pytest.raises(OSError, match="a fake"):
        subprocess.run([sys.executable, "-c", "pass"])
"""


def test_a_fast_test_that_starts_a_process_fails_however_it_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _posixsubprocess

    from probserve.kernels.build import KernelBuildError, compiler

    try:
        cxx = compiler()
    except KernelBuildError as exc:
        pytest.skip(f"no C++ compiler here ({exc}): the allowed program is what this checks")
    started: list[str] = []

    def fake(where: int) -> Any:
        def start(*args: Any, **kwargs: Any) -> int:
            started.append(os.fsdecode(args[where][0]) if where >= 0 else "fork")
            raise OSError("not started: a fake")

        return start

    for owner, name, where in [
        (subprocess, "_fork_exec", 0), (_posixsubprocess, "fork_exec", 0),
        (os, "posix_spawn", 1), (os, "posix_spawnp", 1), (os, "fork", -1),
        (os, "forkpty", -1), (os, "system", -1),
    ]:  # fmt: skip
        monkeypatch.setattr(owner, name, fake(where))
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_made=TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1, errors=2)
    out = result.stdout.str()
    assert (
        "test_made.py::test_uses_the_server is not marked slow but uses the session's server "
        "(base_url)" in out
    )
    assert not (pytester.path / "server-started").exists()  # failed before its fixtures
    for test, how in [
        ("test_is_the_first_to_need_the_worker", f"subprocess._fork_exec: {sys.executable}"),
        ("test_spawns_a_worker_of_its_own", f"_posixsubprocess.fork_exec: {sys.executable}"),
    ]:
        assert f"test_made.py::{test} is not marked slow but started a process ({how})" in out
    assert started == [cxx, sys.executable]  # the compiler, and the slow test's process
