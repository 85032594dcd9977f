"""The playground page in a real headless Chromium (Playwright): what it shows equals what the
API returns for the same request. Screenshots of each mode go to $PLAYGROUND_SHOTS (the ones in
docs/ were made so: `PLAYGROUND_SHOTS=docs make test PYTEST_ARGS=tests/test_playground.py`)."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright import sync_api

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no Chromium on this machine (the Makefile installs Debian's chromium where apt works)",
        allow_module_level=True,
    )

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update"],
        )  # fmt: skip
        yield b
        b.close()


@pytest.fixture
def page(browser, base_url: str) -> Iterator[object]:  # type: ignore[no-untyped-def]
    pg = browser.new_page(viewport={"width": 1100, "height": 800})
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(f"{base_url}/")  # redirects to /playground
    assert pg.url.endswith("/playground")
    pg.wait_for_function("document.querySelector('#model').options.length > 0")
    yield pg
    assert not errors, errors  # the page has no console errors
    pg.close()


def _shot(pg, name: str) -> None:  # type: ignore[no-untyped-def]
    where = os.environ.get("PLAYGROUND_SHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(Path(where) / f"playground-{name}.png"), full_page=True)


def _run(pg) -> None:  # type: ignore[no-untyped-def]
    pg.click("#run")
    pg.wait_for_function("document.body.dataset.idle === 'true'", timeout=120_000)
    assert "error" not in pg.inner_text("#status")


def _settings(pg, max_tokens: int = 6, k: int = 3) -> None:  # type: ignore[no-untyped-def]
    pg.fill("#temperature", "0")
    pg.fill("#max_tokens", str(max_tokens))
    pg.fill("#k", str(k))


def _tokens(pg) -> list[tuple[str, float | None]]:  # type: ignore[no-untyped-def]
    spans = pg.query_selector_all("#outputs .tok")
    out = []
    for s in spans:
        lp = s.get_attribute("data-logprob")
        out.append((s.get_attribute("data-token"), float(lp) if lp else None))
    return out


def test_generate_shows_the_api_figures_and_branches(page, base_url: str):  # type: ignore[no-untyped-def]
    pg = page
    pg.fill("#prompt", PROMPT)
    _settings(pg)
    _run(pg)
    shown = _tokens(pg)
    api = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3},
        timeout=60,
    ).json()["choices"][0]["logprobs"]
    assert [t for t, _ in shown] == api["tokens"]
    for (_, got), want in zip(shown, api["token_logprobs"], strict=True):
        assert abs(got - want) < 1e-4
    # hover shows the token's k alternatives
    first = pg.query_selector("#outputs .tok")
    first.hover()
    assert pg.is_visible("#popover")
    alts = pg.query_selector_all("#popover .alt")
    assert len(alts) >= 3
    assert f"logprob {api['token_logprobs'][0]:.4f}" in pg.inner_text("#popover")
    _shot(pg, "generate")
    # click the second alternative: a new branch that starts with it, as the API says
    alt = alts[1].get_attribute("data-token")
    alts[1].click()
    pg.wait_for_function("document.body.dataset.idle === 'true'", timeout=120_000)
    branch = "".join(t for t, _ in _tokens(pg))
    assert branch.startswith(alt)
    cont = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT + alt, "max_tokens": 6, "temperature": 0},
        timeout=60,
    ).json()["choices"][0]["text"]
    assert branch == alt + cont
    assert len(pg.query_selector_all("#branches li")) == 2  # the tree holds both branches
    _shot(pg, "branch")
    # keyboard: tokens are focusable and focus shows the figures
    pg.focus("#outputs .tok")
    assert pg.is_visible("#popover")


def test_chat_mode_streams_the_api_entries(page, base_url: str):  # type: ignore[no-untyped-def]
    pg = page
    pg.click("#tab-chat")
    pg.fill("#user", QUESTION)
    _settings(pg, max_tokens=5)
    pg.select_option("#scale", "entropy")
    _run(pg)
    shown = _tokens(pg)
    api = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
              "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3},
        timeout=60,
    ).json()["choices"][0]["logprobs"]["content"]  # fmt: skip
    assert [t for t, _ in shown] == [e["token"] for e in api]
    assert all(abs(g - e["logprob"]) < 1e-4 for (_, g), e in zip(shown, api, strict=True))
    assert "entropy" in pg.inner_text("#legend")
    _shot(pg, "chat")


def test_score_mode_equals_an_echo_request(page, base_url: str):  # type: ignore[no-untyped-def]
    pg = page
    text = "The quick brown fox jumps over the lazy dog."
    pg.click("#tab-score")
    pg.fill("#score-text", text)
    pg.fill("#k", "2")
    _run(pg)
    shown = _tokens(pg)
    api = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2},
        timeout=60,
    ).json()["choices"][0]["logprobs"]
    assert [t for t, _ in shown] == api["tokens"]
    values = [v for v in api["token_logprobs"] if v is not None]
    assert shown[0][1] is None
    assert all(abs(g - w) < 1e-4 for (_, g), w in zip(shown[1:], values, strict=True))
    total = float(pg.inner_text("td[data-stat='total logprob']"))
    assert abs(total - sum(values)) < 1e-3
    ppl = float(pg.inner_text("td[data-stat='perplexity']"))
    assert abs(ppl - math.exp(-sum(values) / len(values))) < 1e-2
    _shot(pg, "score")


def test_narrow_window_and_api_key(browser, smol):  # type: ignore[no-untyped-def]
    from server_util import running_server

    with running_server(smol, "--api-key", "sekrit") as url:
        pg = browser.new_page(viewport={"width": 420, "height": 800})
        pg.goto(f"{url}/playground")  # the page itself is open
        pg.wait_for_selector("#key-box:not([hidden])")  # its API calls need the key
        pg.fill("#key", "sekrit")
        pg.click("#key-ok")
        pg.wait_for_function("document.querySelector('#model').options.length > 0")
        pg.fill("#prompt", "Hi")
        _settings(pg, max_tokens=2, k=1)
        _run(pg)
        assert len(_tokens(pg)) == 2
        assert httpx.get(f"{url}/v1/models").status_code == 401
        pg.close()


def test_two_models_side_by_side(browser, smol, tiny_dir):  # type: ignore[no-untyped-def]
    from server_util import running_server

    two = ("--model", "smollm2-135m-instruct", "--served-model-name", "smol")
    two += ("--model", str(tiny_dir), "--served-model-name", "tiny", "--kv-cache-gib", "0.1")
    with running_server(smol, *two) as url:  # each model also answers to its own name
        pg = browser.new_page(viewport={"width": 1100, "height": 800})
        pg.goto(f"{url}/playground")
        pg.wait_for_selector("#side-label:not([hidden])")
        options = [o.get_attribute("value") for o in pg.query_selector_all("#model option")]
        assert options == ["smol", "tiny"]  # one entry per model, not per name
        pg.check("#side")
        pg.fill("#prompt", PROMPT)
        _settings(pg, max_tokens=4, k=2)
        _run(pg)
        columns = pg.query_selector_all("#outputs .column")
        assert [c.query_selector("h3").inner_text() for c in columns] == ["smol", "tiny"]
        texts = [
            [s.get_attribute("data-token") for s in c.query_selector_all(".tok")] for c in columns
        ]
        assert len(texts[0]) == len(texts[1]) == 4 and texts[0] != texts[1]  # two models
        _shot(pg, "side-by-side")
        pg.close()


def test_step_mode_adds_one_token_per_click(page, base_url: str):  # type: ignore[no-untyped-def]
    pg = page
    pg.fill("#prompt", PROMPT)
    _settings(pg, max_tokens=6, k=1)
    pg.check("#step")
    for n in (1, 2, 3):
        _run(pg)
        assert len(_tokens(pg)) == n
    api = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
        timeout=60,
    ).json()["choices"][0]["text"]
    assert "".join(t for t, _ in _tokens(pg)) == api


def test_the_api_examples_run_as_shown(page, base_url: str):  # type: ignore[no-untyped-def]
    """Each route's example (completions, chat, messages, responses, embeddings, rerank,
    distributions) names the selected model and answers 200 with every field implemented."""
    pg = page
    pg.click("#examples summary")
    shown = pg.eval_on_selector_all(
        "#example-list pre", "ps => ps.map(p => [p.dataset.path, p.dataset.body, p.textContent])"
    )
    paths = [p for p, _, _ in shown]
    assert {"/v1/messages", "/v1/embeddings", "/v1/rerank", "/v1/chat/completions"} <= set(paths)
    for path, body, text in shown:
        assert text.startswith(f"curl -s {base_url}{path} ") and f'"model":"{MODEL}"' in text
        r = httpx.post(f"{base_url}{path}", content=body.encode(), timeout=120,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 200, (path, r.text)
        assert "x-ignored-fields" not in r.headers, (path, r.headers["x-ignored-fields"])
    _shot(pg, "examples")
