"""The curl examples of README.md and docs/ sent to the session's server: each ```sh block whose
command is `curl` is parsed (its URL's path, headers and body, sent as they are written), and the
```json block that follows it, the answer it shows, must be what the server answers now: every
string, token, count and key shown, and every number exactly where the server runs the
kernels the docs' numbers come from (below), within 5e-5 elsewhere (the AVX2 path and other CPUs
round differently: docs/logprobs.md). An answer may leave out keys (ids, timestamps); a list may
elide items with "..." (those before it match the answer's first items, those after its last);
a logprobs map (token -> number) shows all its keys; a shown object that is not the whole answer
is matched against the answer's objects that have its keys. A curl block with no answer after
it must still be served (2xx)."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
ELIDED = "..."
# where the docs' numbers were taken: the default server on an Intel Xeon, its kernels on their
# AVX-512 float path (/health's kernel_isa; float products); the same bits on any such machine
# (the AVX2 path or another CPU: within TOLERANCE)
DOCS_VENDOR = "GenuineIntel"
DOCS_KERNELS = {"kernel_isa": ("avx512", "avx512-vnni"), "products": ("float",),
                "block_sums": (False,), "deterministic": (True,)}  # fmt: skip
TOLERANCE = 5e-5


@dataclass(frozen=True)
class Example:
    where: str  # file:line of the curl block
    path: str  # the URL's path (and query)
    method: str
    headers: dict[str, str]
    data: str | None
    answer: Any  # the ```json block after it, parsed; None where there is none


def _curl(command: str, where: str) -> tuple[str, str, dict[str, str], str | None]:
    """A `curl` command's method, path, headers and body; an option this parser does not know
    fails (an example must not be skipped unnoticed)."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert words and words[0] == "curl", f"{where}: one curl command per block: {command!r}"
    method, url, headers, data = None, None, {}, None
    rest = iter(words[1:])
    for word in rest:
        if word in ("-s", "-S", "-sS", "--silent", "--show-error", "-N", "--no-buffer"):
            continue
        if word in ("-H", "--header"):
            name, _, value = next(rest).partition(":")
            headers[name.strip().lower()] = value.strip()
        elif word in ("-d", "--data", "--data-raw", "--data-binary"):
            data = next(rest)
        elif word in ("-X", "--request"):
            method = next(rest)
        elif not word.startswith("-") and url is None:
            url = word
        else:
            raise AssertionError(f"{where}: curl option {word!r} is not understood here")
    assert url is not None, f"{where}: the curl command names no URL"
    parts = urlsplit(url if "://" in url else f"http://{url}")
    assert (parts.hostname, parts.port) == ("localhost", 8000), f"{where}: {url} is not the default"
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return method or ("POST" if data is not None else "GET"), path, headers, data


def examples(doc: Path) -> list[Example]:
    text = doc.read_text()
    blocks = list(FENCE.finditer(text))
    found = []
    for i, block in enumerate(blocks):
        if block.group(1) != "sh" or not re.search(r"^\s*curl\s", block.group(2), re.M):
            continue
        where = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, block.start()) + 1}"
        method, path, headers, data = _curl(block.group(2), where)
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        answer = None
        if after and after.group(1) == "json" and not text[block.end() : after.start()].strip():
            answer = json.loads(after.group(2))
        found.append(Example(where, path, method, headers, data, answer))
    return found


def differences(want: Any, got: Any, where: str, tolerance: float) -> list[str]:
    """How `got` differs from the `want` the docs show (empty: it is what they say)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: {got!r} where the docs show an object"]
        floats = all(isinstance(v, float) for v in want.values())
        if want and floats and set(got) != set(want):  # a logprobs map: all its keys
            return [f"{where}: keys {sorted(got)} where the docs show {sorted(want)}"]
        out = [f"{where}.{k}: missing" for k in want if k not in got]
        for k in want:
            if k in got:
                out += differences(want[k], got[k], f"{where}.{k}", tolerance)
        return out
    if isinstance(want, list):
        if not isinstance(got, list):
            return [f"{where}: {got!r} where the docs show a list"]
        head, tail = want, []
        if ELIDED in want:
            cut = want.index(ELIDED)
            head, tail = want[:cut], want[cut + 1 :]
            assert ELIDED not in tail, f"{where}: one {ELIDED!r} per list"
            if len(got) < len(want) - 1:
                return [f"{where}: {len(got)} items, fewer than the {len(want) - 1} shown"]
        elif len(got) != len(want):
            return [f"{where}: {len(got)} items where the docs show {len(want)}"]
        pairs = [*zip(range(len(head)), head, strict=False)]
        pairs += [(len(got) - len(tail) + j, w) for j, w in enumerate(tail)]
        return [d for j, w in pairs for d in differences(w, got[j], f"{where}[{j}]", tolerance)]
    if isinstance(want, float):
        number = isinstance(got, int | float) and not isinstance(got, bool)
        if not number or abs(got - want) > tolerance:
            return [f"{where}: {got!r} where the docs show {want!r}"]
        return []
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r} where the docs show {want!r}"]
    return []


def _objects(tree: Any) -> list[dict]:
    """Every object in an answer, outermost first."""
    if isinstance(tree, dict):
        return [tree, *(o for v in tree.values() for o in _objects(v))]
    if isinstance(tree, list):
        return [o for v in tree for o in _objects(v)]
    return []


def compared(want: Any, got: Any, tolerance: float) -> list[str]:
    """`want` against the whole answer, or, where the docs show a part of it (keys the answer
    does not have at its top), against each of the answer's objects that have its keys: the
    differences from the closest one."""
    if not isinstance(want, dict) or set(want) <= set(got):
        return differences(want, got, "answer", tolerance)
    fits = [o for o in _objects(got) if set(want) <= set(o)]
    if not fits:
        return [f"no object of the answer has the keys {sorted(want)}"]
    return min((differences(want, o, "part", tolerance) for o in fits), key=len)


def the_docs_machine(health: dict[str, Any]) -> bool:
    """Whether the session's server runs as the docs' numbers were taken (DOCS_VENDOR's CPU,
    DOCS_KERNELS as its /health reports them): there they are the same bits. A server elsewhere
    (PROBSERVE_BASE_URL) runs on a CPU this process cannot see."""
    if os.environ.get("PROBSERVE_BASE_URL"):
        return False
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", cpu, re.M)
    kernels = all(health.get(k) in allowed for k, allowed in DOCS_KERNELS.items())
    return vendor is not None and vendor.group(1) == DOCS_VENDOR and kernels


ALL = [e for doc in DOCS for e in examples(doc)]


def test_the_docs_hold_curl_examples_with_their_answers() -> None:
    """The parser finds the examples (a test over no example would pass whatever the docs say)."""
    readme = [e for e in ALL if e.where.startswith("README.md")]
    assert len(readme) >= 2 and all(e.answer is not None for e in readme), ALL
    assert {e.path for e in readme} >= {"/v1/completions", "/v1/chat/completions"}


def test_the_comparison_sees_a_changed_number_token_and_count() -> None:
    answer = {"id": "x", "choices": [{"logprobs": {"tokens": ["a", "b", "c"],
              "token_logprobs": [None, -1.25, -0.5], "top": {"b": -1.25, "z": -2.0}}}],
              "usage": {"prompt_tokens": 2, "details": {}}}  # fmt: skip
    shown = {"choices": [{"logprobs": {"tokens": ["a", ELIDED, "c"],
             "token_logprobs": [None, ELIDED], "top": {"b": -1.25, "z": -2.0}}}],
             "usage": {"prompt_tokens": 2}}  # fmt: skip
    assert compared(shown, answer, 0.0) == []
    off = json.loads(json.dumps(shown).replace("-1.25", "-1.2500001"))
    assert compared(off, answer, 0.0) and compared(off, answer, 1e-6) == []
    assert compared({**shown, "usage": {"prompt_tokens": 3}}, answer, 1.0)
    renamed = json.loads(json.dumps(shown).replace('"c"', '"d"'))
    assert compared(renamed, answer, 1.0)
    fewer = json.loads(json.dumps(shown).replace(', "z": -2.0', ""))
    assert compared(fewer, answer, 1.0)  # a logprobs map shows all its keys
    part = {"tokens": ["a", "b", "c"], "top": {"b": -1.25, "z": -2.0}}
    assert compared(part, answer, 0.0) == [] and compared({**part, "tokens": ["a"]}, answer, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("example", ALL, ids=[e.where for e in ALL])
def test_a_curl_example_answers_what_the_docs_show(example: Example, http: httpx.Client) -> None:
    r = http.request(
        example.method, example.path, headers=example.headers,
        content=None if example.data is None else example.data.encode(),
    )  # fmt: skip
    assert r.is_success, f"{example.where}: {r.status_code} {r.text}"
    if example.answer is None:
        return
    tolerance = 0.0 if the_docs_machine(http.get("/health").json()) else TOLERANCE
    wrong = compared(example.answer, r.json(), tolerance)
    assert not wrong, f"{example.where} (tolerance {tolerance:g}): " + "; ".join(wrong[:20])
