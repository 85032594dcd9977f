"""`make test-fast` starts no process (README), and this plugin holds it to that: a test not
marked slow that starts one fails, naming it and the process. Two checks, both of which see what
a session or module fixture does on a fast test's behalf:

- at collection, a test not marked slow whose fixtures include the session's server
  (SERVER_FIXTURES, directly or through another fixture) fails at its setup, before any
  fixture starts: it would start the server (and its worker) whenever it runs first;
- while a test runs (its fixtures' setup, its call and their teardown), each way Python starts
  a process (fork, fork_exec under subprocess and multiprocessing, posix_spawn, os.system)
  fails for a test not marked slow. The kernels' compiler is the one exception: it builds (or
  names the build of) their library.

tests/conftest.py loads it (`pytest_plugins`); tests/test_process_guard.py runs it on tests made
for the purpose."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# the session's server: its worker is a process (tests/conftest.py); fixtures built on it
# (client, http, ...) reach it through their own fixtures, which collection sees
SERVER_FIXTURES = frozenset({"base_url"})

_RUNNING = pytest.StashKey[pytest.Item | None]()
_UNDO = pytest.StashKey[list[Callable[[], None]]]()
_STARTS_SERVER = pytest.StashKey[set[str]]()


def _fast(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("slow") is None


def _allowed_program() -> str | None:
    from probserve.kernels.build import KernelBuildError, compiler

    try:
        return compiler()
    except KernelBuildError:  # no compiler: nothing is allowed
        return None


def _program(argv: Any) -> str:
    if isinstance(argv, list | tuple) and argv:
        return os.fsdecode(argv[0])
    return repr(argv)


def _guarded(config: pytest.Config, how: str, original: Any, program_of: Any) -> Any:
    """`original` (a way of starting a process), failing while a fast test runs unless what it
    starts is the kernels' compiler (`program_of` names it from the call's arguments)."""

    def guard(*args: Any, **kwargs: Any) -> Any:
        item = config.stash.get(_RUNNING, None)
        if _fast(item):
            program = program_of(args) if program_of is not None else None
            if program is None or program != _allowed_program():
                assert item is not None
                raise AssertionError(
                    f"{item.nodeid} is not marked slow but started a process ({how}: "
                    f"{program or 'a copy of this one'}): mark it slow (make test-fast starts none)"
                )
        return original(*args, **kwargs)

    return guard


def _install(config: pytest.Config) -> Iterator[Callable[[], None]]:
    """Each patch of a process-starting function, with how to undo it."""
    import _posixsubprocess

    spots: list[tuple[Any, str, Any]] = [
        (subprocess, "_fork_exec", lambda a: _program(a[0])),  # subprocess.Popen
        (_posixsubprocess, "fork_exec", lambda a: _program(a[0])),  # multiprocessing's spawn
        (os, "posix_spawn", lambda a: _program(a[1])),
        (os, "posix_spawnp", lambda a: _program(a[1])),
        (os, "fork", None),  # multiprocessing's fork, os.spawn*
        (os, "forkpty", None),
        (os, "system", lambda a: str(a[0]).split()[0] if a and str(a[0]).split() else None),
    ]
    for owner, name, program_of in spots:
        original = getattr(owner, name, None)
        if original is None:
            continue
        setattr(owner, name, _guarded(config, f"{owner.__name__}.{name}", original, program_of))
        yield lambda owner=owner, name=name, original=original: setattr(owner, name, original)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RUNNING] = None
    config.stash[_UNDO] = list(_install(config))


def pytest_unconfigure(config: pytest.Config) -> None:
    for undo in reversed(config.stash.get(_UNDO, [])):
        undo()
    config.stash[_UNDO] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_STARTS_SERVER] = {
        item.nodeid
        for item in items
        if _fast(item) and SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
    }


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in item.config.stash.get(_STARTS_SERVER, set()):
        uses = sorted(SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))
        raise AssertionError(
            f"{item.nodeid} is not marked slow but uses the session's server ({', '.join(uses)}),"
            " which starts a process: mark it slow (make test-fast starts none)"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    item.config.stash[_RUNNING] = item
    try:
        yield
    finally:
        item.config.stash[_RUNNING] = None
