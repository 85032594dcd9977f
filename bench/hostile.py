"""Hostile-client check: requests meant to stop, freeze or starve the server, each followed by a
canary.

For every case the script sends the hostile request(s) while it polls `/health`, then checks:
- the hostile request got what it should (a 4xx envelope with the right `param`, or a correct
  answer);
- the event loop stayed responsive (every `/health` answered within `--health-bound` seconds);
- the canary (a greedy completion with logprobs) answers exactly as it did before any case;
- `/health` says ok, with nothing waiting, running or held.
It prints one JSON line per case and a summary, and exits 1 if any case failed. Loopback only;
bounded in count and time.

    .venv/bin/python bench/hostile.py --start
    .venv/bin/python bench/hostile.py --url http://127.0.0.1:8000

`long_prompt_flood` (64 concurrent distinct long prompts, for a hybrid model's recurrent state:
minutes of prefill) runs only where `--case` names it:

    .venv/bin/python bench/hostile.py --url URL --case long_prompt_flood --kv-budget-gib 4

So do the prefix cache on disk's cases, against a server started with `--prefix-cache-dir DIR
--prefix-cache-disk-gib G --prefix-cache-gib 0` (nothing kept in memory past the next request,
so blocks go to disk at once), given the same directory and budget to check:
`prefix_disk_churn` sends `--churn-prefixes` distinct prompts (`--churn-blocks` full blocks each,
8 in flight, one token each) until the budget has evicted; `prefix_disk_garbage` spoils the
block files of prompts it then sends again (truncated, a flipped byte, empty, garbage, another
fingerprint's header): each skipped and counted, never served, the same answers.

    .venv/bin/python bench/hostile.py --url URL --case prefix_disk_churn --case \\
        prefix_disk_garbage --prefix-dir DIR --prefix-disk-gib G [--churn-prefixes 10000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from bench_serve import start_server  # type: ignore[import-not-found]

CANARY = {
    "prompt": "The capital of France is",
    "max_tokens": 4,
    "temperature": 0,
    "logprobs": 2,
    "echo": True,
}
# timeouts the script's own server runs with (--start), so the slow-client cases finish fast
START_ARGS = ["--header-timeout", "2", "--body-timeout", "2", "--kv-cache-gib", "0.5"]


@dataclass
class Ctx:
    url: str
    client: httpx.Client
    header_timeout: float | None  # known when the script started the server
    # long_prompt_flood: each prompt's length, and the engine's budget (--kv-cache-gib) in bytes
    flood_tokens: int = 2000
    kv_budget: float | None = None
    # the prefix cache on disk's cases: the server's --prefix-cache-dir and its budget in bytes
    prefix_dir: str | None = None
    prefix_budget: float | None = None
    churn_prefixes: int = 10000
    churn_blocks: int = 4
    canary_bound: float = 3.0  # the canary's latency after the churn, at most this many times
    figures: dict[str, object] = field(default_factory=dict)  # a case's own, on its line


def expect(r: httpx.Response, status: int, param: str | None = None) -> str | None:
    """None if `r` is the expected envelope, else what is wrong."""
    if r.status_code != status:
        return f"status {r.status_code} (wanted {status}): {r.text[:300]}"
    if status >= 400:
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"not an error envelope: {r.text[:300]}"
        if set(err) != {"message", "type", "param", "code"}:
            return f"envelope fields {sorted(err)}"
        if param is not None and err["param"] != param:
            return f"param {err['param']!r} (wanted {param!r})"
    return None


def post_raw(ctx: Ctx, path: str, raw: bytes) -> httpx.Response:
    return ctx.client.post(path, content=raw, headers={"content-type": "application/json"})


def completion(ctx: Ctx, status: int, param: str | None = None, **body: object) -> str | None:
    return expect(ctx.client.post("/v1/completions", json={"prompt": "Hi", **body}), status, param)


def chat(ctx: Ctx, status: int, param: str | None = None, **body: object) -> str | None:
    msgs = [{"role": "user", "content": "Hi"}]
    r = ctx.client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **body})
    return expect(r, status, param)


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


# ---- the cases ---------------------------------------------------------------------------------


def huge_seeds(ctx: Ctx) -> str | None:
    return first_problem(
        completion(ctx, 400, "seed", max_tokens=2, seed=2**64),
        completion(ctx, 400, "seed", max_tokens=2, seed=-(2**63) - 1),
        completion(ctx, 200, None, max_tokens=2, seed=2**63 - 1, n=2),
        completion(ctx, 200, None, max_tokens=2, seed=-(2**63)),
    )


def long_id_prompts(ctx: Ctx) -> str | None:
    """Prompts of more ids than one sequence may hold (`/v1/models`' max_model_len: at least
    24,000 and 9,000 ids, one past the limit where it is larger), one and four to a request, and
    a 3.5 MB body of ids: each a 400 naming the prompt."""
    limit = int(ctx.client.get("/v1/models").json()["data"][0]["max_model_len"])
    n = max(24_000, limit + 1)
    problems = [completion(ctx, 400, "prompt", prompt=[504] * n, max_tokens=1)]
    raw = b'{"max_tokens": 1, "prompt": [' + b",".join([b"504"] * 690_000) + b"]}"  # 3.5 MB
    problems.append(expect(post_raw(ctx, "/v1/completions", raw), 400, "prompt"))
    many = [[504] * max(9000, limit + 1)] * 4
    problems.append(completion(ctx, 400, "prompt", prompt=many, max_tokens=1))
    return first_problem(*problems)


def client_templates(ctx: Ctx) -> str | None:
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    nested: list = []
    for _ in range(40):
        nested = [nested]
    template_param = "chat_template_kwargs.chat_template"
    return first_problem(
        chat(ctx, 400, template_param, chat_template_kwargs={"chat_template": loop}),
        chat(ctx, 400, "chat_template_kwargs.tokenize", chat_template_kwargs={"tokenize": True}),
        chat(ctx, 400, "chat_template_kwargs", chat_template_kwargs={"a": nested}),
        chat(ctx, 200, None, chat_template_kwargs={"enable_thinking": False}),
        # template syntax in a message is text, never code
        chat(ctx, 200, None, messages=[{"role": "user", "content": loop + '{{ "x" * 10**10 }}'}]),
    )


def cached_prompt_scoring(ctx: Ctx) -> str | None:
    prompt = " ".join(f"word{i}" for i in range(300))
    return first_problem(
        completion(ctx, 200, None, prompt=prompt, max_tokens=0),
        completion(ctx, 200, None, prompt=prompt, max_tokens=1, echo=True, logprobs=1, n=4),
    )


def lone_surrogates(ctx: Ctx) -> str | None:
    s = b'"Hi \\ud800"'
    msgs = b'[{"role": "user", "content": ' + s + b"}]"
    return first_problem(
        expect(post_raw(ctx, "/v1/completions", b'{"prompt": ' + s + b"}"), 400, "prompt"),
        expect(post_raw(ctx, "/v1/completions", b'{"prompt": [' + s + b"]}"), 400, "prompt[0]"),
        expect(post_raw(ctx, "/v1/chat/completions", b'{"messages": ' + msgs + b"}"), 400),
        expect(post_raw(ctx, "/tokenize", b'{"prompt": ' + s + b"}"), 400, "prompt"),
        expect(post_raw(ctx, "/v1/completions", b'{"prompt": "x", "model": ' + s + b"}"), 400),
        expect(post_raw(ctx, "/v1/completions", b'{"prompt": "x", "stop": ' + s + b"}"), 400),
        expect(post_raw(ctx, "/v1/completions", b'{"prompt": "x", "user": "\\udfff"}'), 400),
    )


def tiny_temperature(ctx: Ctx) -> str | None:
    body = {"prompt": "The capital of France is", "max_tokens": 4}
    greedy = ctx.client.post("/v1/completions", json={**body, "temperature": 0}).json()
    tiny = ctx.client.post("/v1/completions", json={**body, "temperature": 1e-40}).json()
    a, b = greedy["choices"][0]["text"], tiny["choices"][0]["text"]
    return None if a == b else f"temperature 1e-40 gave {b!r}, greedy {a!r}"


def non_finite_and_huge_numbers(ctx: Ctx) -> str | None:
    raw = b'{"prompt": "x", "max_tokens": 2, "repetition_penalty": Infinity}'
    return first_problem(
        expect(post_raw(ctx, "/v1/completions", raw), 400, "repetition_penalty"),
        expect(post_raw(ctx, "/v1/completions", raw.replace(b"Infinity", b"NaN")), 400),
        completion(ctx, 400, "logprobs", logprobs=10**30),
        completion(ctx, 400, "max_tokens", max_tokens=10**30),
        completion(ctx, 400, "n", n=10**30),
        completion(ctx, 400, "top_k", top_k=-(10**30)),
        completion(ctx, 400, "stop_token_ids", stop_token_ids=[2] * 5000),
        completion(ctx, 400, "logit_bias", logit_bias={str(i): 1 for i in range(2000)}),
        completion(ctx, 400, "logit_bias", logit_bias={str(10**30): 1}),
        chat(ctx, 400, "top_logprobs", logprobs=True, top_logprobs=10**30),
    )


def deep_nesting(ctx: Ctx) -> str | None:
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return expect(post_raw(ctx, "/v1/completions", raw), 400)


def big_tokenize(ctx: Ctx) -> str | None:
    return first_problem(
        expect(ctx.client.post("/tokenize", json={"prompt": "lorem ipsum " * 300_000}), 400),
        expect(ctx.client.post("/detokenize", json={"tokens": [504] * 500_000}), 200),
        expect(ctx.client.post("/tokenize", json={"prompt": "lorem ipsum " * 20_000}), 200),
    )


def disconnects(ctx: Ctx) -> str | None:
    body = {"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    for _ in range(5):
        with ctx.client.stream("POST", "/v1/completions", json=body) as r:
            for _line in r.iter_lines():
                break
    for _ in range(3):
        with contextlib.suppress(httpx.TimeoutException):
            ctx.client.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
    return None


def embedding_flood(ctx: Ctx) -> str | None:
    """About a thousand embedding inputs in flight (40 requests of 25) must not hold a one-token
    completion back until they are done (#60: 3.5-5.8 s before the scheduler's lanes)."""
    texts = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(25)]
    statuses: list[int] = []
    lock = threading.Lock()

    def flood() -> None:
        r = ctx.client.post("/v1/embeddings", json={"input": texts}, timeout=600)
        with lock:
            statuses.append(r.status_code)

    quick_body = {"prompt": "Hi", "max_tokens": 1}
    start = time.monotonic()
    ctx.client.post("/v1/completions", json=quick_body)
    alone = time.monotonic() - start  # the same completion on an idle server
    threads = [threading.Thread(target=flood) for _ in range(40)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while ctx.client.get("/health").json()["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # until the flood is running
    with lock:
        answered_before = len(statuses)  # all 40: the flood ended before the poll saw it run
    start = time.monotonic()
    quick = ctx.client.post("/v1/completions", json=quick_body)
    waited = time.monotonic() - start
    with lock:
        answered_first = len(statuses)
    for thread in threads:
        thread.join()
    flood_took = time.monotonic() - start
    print(f"embedding_flood: the one-token completion took {waited:.2f} s in the flood "
          f"({alone:.2f} s alone); {answered_first} of 40 flood requests had answered by then; "
          f"the flood ended {flood_took:.2f} s after it was sent; {answered_before} had "
          f"answered before it was sent", file=sys.stderr)  # fmt: skip
    if quick.status_code != 200 or any(s not in (200, 429) for s in statuses):
        return f"statuses: quick {quick.status_code}, flood {sorted(set(statuses))}"
    if answered_before == 40:  # a model that embeds the flood faster than it is seen running
        ctx.figures["flood_over_first"] = True
        return None
    return "the completion waited for the whole flood" if answered_first == 40 else None


def _metric(ctx: Ctx, name: str, **labels: str) -> float:
    """The sum of /metrics' samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in ctx.client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


LEFT_STREAMS = [  # (route, body, the event after which the client hangs up)
    ("/v1/responses", {"input": "Count", "max_output_tokens": 300, "ignore_eos": True},
     "response.created"),
    ("/v1/responses", {"input": "Count", "max_output_tokens": 300, "ignore_eos": True},
     "response.output_text.delta"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 300,
                      "ignore_eos": True}, "message_start"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count"}],
                              "max_tokens": 300, "ignore_eos": True}, "data:"),
]  # fmt: skip


def left_streams(ctx: Ctx) -> str | None:
    """Streams the client leaves right after their first event (or first text delta): each is
    counted as a 499 of its route and its sequence as aborted."""
    for path, body, event in LEFT_STREAMS:
        http = {"handler": path, "status": "499"}

        def counts(http: dict[str, str] = http) -> tuple[float, float]:
            return (
                _metric(ctx, "http_requests_total", **http),
                _metric(ctx, "vllm:request_success_total", finished_reason="abort"),
            )

        before = counts()
        with ctx.client.stream("POST", path, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if event in line:
                    break
        deadline = time.monotonic() + 30
        while True:
            after = counts()
            if after == (before[0] + 1, before[1] + 1):
                break
            if time.monotonic() > deadline:
                return f"{path} left after {event}: 499s and aborts {before} -> {after}"
            time.sleep(0.05)
    return None


def unbudgeted_probe(ctx: Ctx) -> str | None:
    """inspect-ai's start-up probe: a Responses request with `reasoning` and no
    max_output_tokens. The server's default budget (the model card's max_tokens_default) bounds
    it; it once ran to the end of the context (7,637 tokens, 196 s)."""
    card = ctx.client.get("/v1/models").json()["data"][0]
    bound = card.get("max_tokens_default")
    if not isinstance(bound, int):
        return f"the model card names no default budget: {bound!r}"
    probe = {
        "input": "Please say 'hello, world'",
        "reasoning": {"effort": "low", "summary": "auto"},
    }
    r = ctx.client.post("/v1/responses", json=probe)
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:300]}"
    used = r.json()["usage"]["output_tokens"]
    return None if used <= bound else f"{used} output tokens past the default of {bound}"


def hog_the_batch(ctx: Ctx) -> str | None:
    """One request with n = the largest allowed must not keep a one-token request waiting until
    it is done."""
    done = threading.Event()
    result: dict[str, object] = {}

    def hog() -> None:
        body = {"prompt": "Count:", "max_tokens": 100, "ignore_eos": True, "n": 64}
        result["hog"] = ctx.client.post("/v1/completions", json=body, timeout=600).status_code
        done.set()

    thread = threading.Thread(target=hog)
    thread.start()
    deadline = time.monotonic() + 60
    while ctx.client.get("/health").json()["running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # until the hog is running
    quick = ctx.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    hog_done_first = done.is_set()
    thread.join()
    if quick.status_code != 200 or result.get("hog") != 200:
        return f"statuses: quick {quick.status_code}, hog {result.get('hog')}"
    return "the one-token request waited for the whole hog" if hog_done_first else None


def slow_clients(ctx: Ctx) -> str | None:
    if ctx.header_timeout is None:
        return None  # the server's timeouts are unknown: only checked with --start
    host, port = urlparse(ctx.url).hostname or "127.0.0.1", urlparse(ctx.url).port or 80
    with socket.create_connection((host, port)) as s:  # headers never finished
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(ctx.header_timeout + 10)
        if s.recv(1024) != b"":
            return "a connection with unfinished headers got an answer instead of being closed"
    with socket.create_connection((host, port)) as s:  # fewer bytes than Content-Length
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt":'
        )
        s.settimeout(ctx.header_timeout + 40)
        head = s.recv(1024)
        if not head.startswith(b"HTTP/1.1 408"):
            return f"a short body got {head[:60]!r}"
    with socket.create_connection((host, port)) as s:  # a websocket upgrade
        s.sendall(
            b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        s.settimeout(10)
        if s.recv(1024).startswith(b"HTTP/1.1 101"):
            return "a websocket was accepted"
    return None


def oversized_chunked_bodies(ctx: Ctx) -> str | None:
    """Bodies past --max-body-bytes (4 MiB by default) in 1 MiB chunks: the client writes its
    whole body, then reads. The 413 must arrive whole, never a connection reset, also when the
    client goes on sending after the answer is out (a server that closes with the client's bytes
    unread resets the connection)."""
    host, port = urlparse(ctx.url).hostname or "127.0.0.1", urlparse(ctx.url).port or 80
    mib = b"x" * 2**20
    piece = b"%x\r\n%s\r\n" % (len(mib), mib)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    for after_answer in (0, 3):  # 1 MiB chunks still sent once the 413's first bytes are in
        try:
            with socket.create_connection((host, port)) as s:
                s.settimeout(60)
                s.sendall(head)
                for _ in range(5):
                    s.sendall(piece)
                if after_answer:
                    while not s.recv(16, socket.MSG_PEEK).startswith(b"HTTP/1.1 413"):
                        time.sleep(0.01)
                for _ in range(after_answer):
                    time.sleep(0.1)
                    s.sendall(piece)
                s.sendall(b"0\r\n\r\n")
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
        except OSError as exc:
            return f"five 1 MiB chunks (+{after_answer} after the answer): {exc!r}"
        status, _, body = answer.partition(b"\r\n\r\n")
        if not status.startswith(b"HTTP/1.1 413") or b'"request_too_large"' not in body:
            return f"five 1 MiB chunks (+{after_answer} after the answer) got {answer[:200]!r}"
    return None


def logprobs_extensions(ctx: Ctx) -> str | None:
    long_prompt = [504] * 8000
    return first_problem(
        completion(ctx, 400, "logprob_token_ids", logprobs=1, logprob_token_ids=[2] * 5000),
        completion(ctx, 400, "logprob_token_ids", logprobs=1, logprob_token_ids=[10**30]),
        expect(
            ctx.client.post("/v1/distributions", json={"prompt": long_prompt}), 400, "positions"
        ),
        expect(
            ctx.client.post(
                "/v1/score", json={"query": "q", "items": ["a"] * 10_000, "label_token_ids": [1]}
            ),
            400,
            "items",
        ),
        completion(
            ctx,
            200,
            None,
            prompt=" ".join(["w"] * 2000),
            max_tokens=0,
            echo=True,
            logprobs=1,
            return_entropy=True,
            logprob_token_ids=list(range(256)),
        ),
    )


def forged_log_lines(ctx: Ctx) -> str | None:
    return expect(ctx.client.get("/v1/models/%0A2026-01-01 INFO forged"), 404)


def wrong_typed_lists(ctx: Ctx) -> str | None:
    """400k wrong-typed entries in a list of each newer route: one 400 at parse time, naming it."""
    many = b"[" + b",".join([b"{}"] * 400_000) + b"]"
    bodies = [
        ("/v1/score", b'{"query": "q", "label_token_ids": [1], "items": %s}' % many, "items"),
        ("/v1/distributions", b'{"prompt": "x", "positions": %s}' % many, "positions"),
        ("/v1/responses", b'{"input": "x", "include": %s}' % many, "include"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "logprob_token_ids": %s}' % many,
            "logprob_token_ids",
        ),
    ]
    problems = []
    for path, raw, param in bodies:
        r = post_raw(ctx, path, raw)
        got = r.json().get("error", {}).get("param") if r.status_code == 400 else None
        if not (got or "").startswith(param):
            problems.append(f"{path}: {r.status_code} param {got!r} (wanted {param})")
    return first_problem(*problems)


def score_counts_first(ctx: Ctx) -> str | None:
    """4000 items after a 6000-id query: refused by count before any query+item is built."""
    body = {"query": [504] * 6000, "items": [[504]] * 4000, "label_token_ids": [1]}
    return expect(ctx.client.post("/v1/score", json=body), 400, "items")


def big_distributions(ctx: Ctx) -> str | None:
    """Four 512-row JSON distribution answers at once (133 MB of base64 each: the whole row
    budget)."""
    body = {"prompt": " w" * 600, "positions": list(range(512))}

    codes: list[int] = []

    def one() -> None:
        codes.append(ctx.client.post("/v1/distributions", json=body, timeout=600).status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return None if codes == [200] * 4 else f"statuses {codes}"


def slow_distribution_readers(ctx: Ctx) -> str | None:
    """Four clients that ask for 512 rows each and never read: the row budget (2048) stays
    held, so a fifth request is a 429 until they leave."""
    host, port = urlparse(ctx.url).hostname or "127.0.0.1", urlparse(ctx.url).port or 80
    body = json.dumps({"prompt": " w" * 600, "positions": list(range(512))}).encode()
    request = (b"POST /v1/distributions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
               b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    socks = []
    try:
        for _ in range(4):
            s = socket.create_connection((host, port), timeout=120)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            s.sendall(request)
            if not s.recv(12).startswith(b"HTTP/1.1 200"):
                return "a slow reader's request was not answered 200"
            socks.append(s)
        time.sleep(1.0)
        r = ctx.client.post("/v1/distributions", json={"prompt": "x y z", "positions": [0]})
        return expect(r, 429)
    finally:
        for s in socks:
            s.close()


def big_logprobs_answers(ctx: Ctx) -> str | None:
    """A ~2300-token chat prompt with prompt_logprobs and 256 target ids: 590k values."""
    body = {"messages": [{"role": "user", "content": " w" * 2300}], "max_tokens": 1,
            "prompt_logprobs": 0, "logprob_token_ids": list(range(256))}  # fmt: skip
    return expect(ctx.client.post("/v1/chat/completions", json=body, timeout=600), 200)


DEEP = "[" * 5000 + "]" * 5000  # JSON text nested far past any bound


def deep_json_texts(ctx: Ctx) -> str | None:
    """Every JSON string of a client's that the server parses: a 400 naming it."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    msgs = [{"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": DEEP}]  # fmt: skip
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP}]
    return first_problem(
        completion(ctx, 400, "guided_json", max_tokens=1, guided_json=DEEP),
        chat(ctx, 400, "messages[0].tool_calls[0].function.arguments", messages=msgs),
        chat(ctx, 400, "messages[1].content", messages=[{"role": "user", "content": "x"}, msgs[1]]),
        expect(ctx.client.post("/v1/responses", json={"input": items}), 400),
        expect(ctx.client.post("/tokenize", json={"messages": msgs}), 400),
    )


def hostile_grammars(ctx: Ctx) -> str | None:
    """Grammars that meet llguidance's bounds: at their first token a 400 at admission; an
    ambiguous one partway, a clean `grammar_limit` finish (never a 500)."""
    ref = {
        "$ref": "#/$defs/a",
        "$defs": {
            "a": {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/a"}}}
        },
    }
    ambiguous = 'start: s\ns: s s s s s s | "a" | ""'
    r = ctx.client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 200, "temperature": 0, "guided_grammar": ambiguous},
    )
    limit = (
        None
        if r.status_code == 200
        and r.json()["choices"][0]["finish_reason"] in ("grammar_limit", "length", "stop")
        else f"ambiguous grammar: {r.status_code} {r.text[:200]}"
    )
    return first_problem(
        completion(ctx, 400, "guided_grammar", max_tokens=5, guided_grammar='start: "a" start'),
        completion(ctx, 400, "guided_json", max_tokens=5, guided_json=ref),
        completion(ctx, 400, "guided_regex", max_tokens=5, guided_regex="(a{1000}){1000}"),
        limit,
    )


def unknown_keys(ctx: Ctx) -> str | None:
    """300,000 unknown keys (3.5 MB): refused at the 17th, not one error each."""
    body = {"prompt": "x", **{f"k{i}": 1 for i in range(300_000)}}
    return completion(ctx, 400, "k16", **body)


def n64_heavy_schema(ctx: Ctx) -> str | None:
    """n = 64 with a 1,100-property (63 KB) schema: one matcher built, not 64; a one-token
    request sent meanwhile answers within a few seconds."""
    formats = ["email", "date-time", "uuid", "date", "time", "ipv4", "hostname", "uri"]
    props = {f"f{i:04d}": {"type": "string", "format": formats[i % 8]} for i in range(1100)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    result: dict[str, object] = {}

    def heavy() -> None:
        body = {"prompt": "JSON:", "max_tokens": 8, "n": 64, "guided_json": schema}
        result["heavy"] = ctx.client.post("/v1/completions", json=body, timeout=600).status_code

    thread = threading.Thread(target=heavy)
    thread.start()
    time.sleep(0.5)
    started = time.perf_counter()
    quick = ctx.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    waited = time.perf_counter() - started
    thread.join()
    if quick.status_code != 200 or result.get("heavy") != 200:
        return f"statuses: quick {quick.status_code}, heavy {result.get('heavy')}"
    return f"the one-token request waited {waited:.1f} s" if waited > 5 else None


def largest_choice(ctx: Ctx) -> str | None:
    """A choice of exactly --max-grammar-choices (1024) labels is served (it met llguidance's
    bound on a parser row); 1,025 is refused naming the field."""
    labels = [f"label number {i:04d}" for i in range(1024)]
    body = {"prompt": "Pick one:", "max_tokens": 12, "temperature": 0, "guided_choice": labels}
    r = ctx.client.post("/v1/completions", json=body)
    if r.status_code != 200 or r.json()["choices"][0]["text"] not in labels:
        return f"1024 labels: {r.status_code} {r.text[:300]}"
    return completion(ctx, 400, "structured_outputs.choice", max_tokens=1,
                      structured_outputs={"choice": [*labels, "x"]})  # fmt: skip


def nested_unknown_keys(ctx: Ctx) -> str | None:
    """Unknown keys inside a rerank document object are named back, not dropped silently."""
    doc = {"text": "Paris is in France.", "title": "Paris", "meta": {"k": 1}}
    r = ctx.client.post("/v1/rerank", json={"query": "Where is Paris?", "documents": [doc]})
    ignored = r.headers.get("x-ignored-fields")
    if r.status_code != 200 or ignored != "documents[0].title, documents[0].meta":
        return f"rerank document: {r.status_code}, X-Ignored-Fields {ignored!r}"
    return None


def errors_name_their_field(ctx: Ctx) -> str | None:
    """An empty embeddings input is `input`'s fault; a 400,000-character rerank query that
    alone fills the context is `query`'s (not `documents`')."""
    long = "q " * 200_000
    return first_problem(
        expect(ctx.client.post("/v1/embeddings", json={"input": []}), 400, "input"),
        expect(ctx.client.post("/v1/rerank", json={"query": long, "documents": ["a"]}), 400,
               "query"),
    )  # fmt: skip


def booleans_as_numbers(ctx: Ctx) -> str | None:
    """JSON's true and false are no token ids, lengths or counts: a 400 naming the field."""
    score = {"query": [True], "items": [[504]], "label_token_ids": [1]}
    return first_problem(
        expect(ctx.client.post("/v1/embeddings", json={"input": [True, False]}), 400, "input[0]"),
        completion(ctx, 400, "prompt[0]", prompt=[True, 504], max_tokens=1),
        completion(ctx, 400, "max_tokens", max_tokens=True),
        completion(ctx, 400, "n", max_tokens=1, n=True),
        expect(ctx.client.post("/v1/score", json=score), 400, "query[0]"),
        chat(ctx, 400, "max_tokens", max_tokens=False),
    )


def two_spellings_disagree(ctx: Ctx) -> str | None:
    """Chat's max_new_tokens beside a different max_tokens: a 400 naming it, not a winner."""
    return first_problem(
        chat(ctx, 400, "max_new_tokens", max_tokens=2, max_new_tokens=3),
        chat(ctx, 400, "max_tokens", max_tokens=3, max_completion_tokens=2),
        chat(ctx, 200, None, max_tokens=2, max_new_tokens=2),
    )


def duplicate_call_ids(ctx: Ctx) -> str | None:
    """Two calls of one id (a result would answer both): a 400 naming the second, on
    /v1/messages (Anthropic's envelope), chat and Responses."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}
    anthropic = {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [use, use]},
        {"role": "user", "content": [result]}]}  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"}]  # fmt: skip
    fc = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [fc, fc, {"type": "function_call_output", "call_id": "c1", "output": "1"}]
    r = ctx.client.post("/v1/messages", json=anthropic)
    param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
    return first_problem(
        None if param == "messages[1].content[1].id" else f"messages: {r.status_code} {r.text}",
        chat(ctx, 400, "messages[1].tool_calls[1].id", messages=msgs),
        expect(ctx.client.post("/v1/responses", json={"input": items}), 400, "input[1].call_id"),
    )


def long_prompt_flood(ctx: Ctx) -> str | None:
    """64 concurrent long prompts, each distinct (nothing shared in the prefix cache): every one
    answers, the sequences running at once never hold more recurrent state (a hybrid model's,
    /health's `recurrent_state_bytes`) than the KV budget, and the engine's resident memory grows
    by no more than that budget (with --kv-budget-gib; admission counts the state)."""
    first = ctx.client.get("/health").json()
    rss0 = float(first.get("process_resident_memory_bytes") or 0)
    peak = {"state": 0.0, "rss": rss0, "running": 0}
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=ctx.url, timeout=30) as c:
            while not stop.is_set():
                h = c.get("/health").json()
                peak["state"] = max(peak["state"], float(h.get("recurrent_state_bytes") or 0))
                peak["rss"] = max(peak["rss"], float(h.get("process_resident_memory_bytes") or 0))
                peak["running"] = max(peak["running"], int(h.get("running") or 0))
                stop.wait(0.2)

    statuses: list[int] = []

    def one(i: int) -> None:
        ids = [100 + (i * 7919 + j * 104729) % 900 for j in range(ctx.flood_tokens)]
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "logprobs": 1}
        statuses.append(ctx.client.post("/v1/completions", json=body, timeout=1800).status_code)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    ctx.figures.update({**peak, "rss_before": rss0, "statuses": sorted(set(statuses))})
    if statuses.count(200) != 64:
        return f"statuses {sorted(statuses)}"
    if ctx.kv_budget is not None:
        if peak["state"] > ctx.kv_budget:
            return f"recurrent state {peak['state']:.0f} B over the budget {ctx.kv_budget:.0f} B"
        if peak["rss"] - rss0 > ctx.kv_budget + 2**29:
            return f"the engine grew {(peak['rss'] - rss0) / 2**20:.0f} MiB (budget + 512 MiB)"
    return None


# ---- the prefix cache on disk (--prefix-cache-dir): opt-in -------------------------------------


def disk_block_bytes(root: Path) -> tuple[int, int]:
    """What the block files (and writers' temporary files) under `root` take now, in bytes, and
    the largest one; files deleted while the walk runs are not counted."""
    from probserve.engine.core.disk_cache import SUFFIX

    total = largest = 0
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(SUFFIX) or name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    size = os.stat(os.path.join(folder, name)).st_size
                    total += size
                    largest = max(largest, size)
    return total, largest


def disk_figures(client: httpx.Client) -> dict[str, object]:
    """/health's prefix_cache_disk_* figures, its fingerprint and the KV block size."""
    h = client.get("/health").json()
    out = {k: v for k, v in h.items() if k.startswith("prefix_cache_disk_")}
    out["system_fingerprint"] = h.get("system_fingerprint")
    out["block_size"] = (h.get("numerics") or {}).get("block_size")
    return out


def settled_disk(client: httpx.Client, seconds: float = 120) -> dict[str, object]:
    """/health's disk figures once the writer is done (writes and drops unchanged for 1 s)."""
    deadline = time.monotonic() + seconds
    last = disk_figures(client)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = disk_figures(client)
        keys = ("prefix_cache_disk_writes", "prefix_cache_disk_dropped")
        if all(now.get(k) == last.get(k) for k in keys):
            return now
        last = now
    return last


def distinct_prompt(i: int, salt: int, length: int) -> list[int]:
    """Token ids of prompt `i`: its first block already differs from every other prompt's (its
    first four ids spell `i` and this run's `salt`), so no two share a cached block."""
    head = [i % 900, i // 900 % 900, salt % 900, salt // 900 % 900]
    return [100 + (t if j < 4 else (i * 7919 + j * 104729) % 900) for j, t in
            enumerate(head + [0] * (length - 4))][:length]  # fmt: skip


def canary_seconds(client: httpx.Client, tries: int = 10) -> float:
    """The canary's latency: the fastest of `tries` (one slow answer is the machine's noise)."""
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        client.post("/v1/completions", json=CANARY).raise_for_status()
        best = min(best, time.perf_counter() - t)
    return best


def disk_setup(ctx: Ctx) -> tuple[Path, float, dict[str, object]] | str:
    """The directory, its budget and /health's disk figures, or what is missing."""
    if ctx.prefix_dir is None or ctx.prefix_budget is None:
        return "give --prefix-dir and --prefix-disk-gib (the server's --prefix-cache-dir and -gib)"
    first = disk_figures(ctx.client)
    if first.get("prefix_cache_disk_writes") is None or not first.get("block_size"):
        return f"the server reports no prefix cache on disk: {first}"
    return Path(ctx.prefix_dir), ctx.prefix_budget, first


def prefix_disk_churn(ctx: Ctx) -> str | None:
    """`--churn-prefixes` distinct prompts (`--churn-blocks` full KV blocks and one token each,
    one token out, 8 in flight) written to the disk cache until its budget has evicted: every
    request answers, the directory's block files stay within the budget (sampled during the run:
    plus 4 blocks, the file in flight and the walk racing the writer; after it: within it), the
    server reports evictions and a size within the budget, and the canary's latency at the end
    is within --canary-bound times its latency at the start (the slowest /health: the runner's)."""
    setup = disk_setup(ctx)
    if isinstance(setup, str):
        return setup
    root, budget, first = setup
    length = ctx.churn_blocks * int(first["block_size"]) + 1  # type: ignore[call-overload]
    salt = secrets.randbelow(900 * 900)  # a rerun on the same directory writes new blocks
    canary_before = canary_seconds(ctx.client)
    peak = {"bytes": 0, "block": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            total, largest = disk_block_bytes(root)
            peak["bytes"], peak["block"] = max(peak["bytes"], total), max(peak["block"], largest)
            stop.wait(0.2)

    def one(i: int) -> int:
        body = {"prompt": distinct_prompt(i, salt, length), "max_tokens": 1, "temperature": 0}
        return ctx.client.post("/v1/completions", json=body, timeout=600).status_code

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(one, range(ctx.churn_prefixes)))
    finally:
        stop.set()
        sampler.join()
    seconds = time.perf_counter() - started
    last = settled_disk(ctx.client)
    final, largest = disk_block_bytes(root)
    canary_after = canary_seconds(ctx.client)

    def grew(key: str) -> int:
        return int(last[key] or 0) - int(first[key] or 0)  # type: ignore[call-overload]

    ctx.figures.update({
        "requests": len(statuses), "prompt_tokens": length, "seconds": round(seconds, 1),
        "requests_per_s": round(len(statuses) / seconds, 1),
        "writes": grew("prefix_cache_disk_writes"),
        "evictions": grew("prefix_cache_disk_evictions"),
        "dropped": grew("prefix_cache_disk_dropped"), "budget_bytes": int(budget),
        "max_dir_bytes": max(peak["bytes"], final), "final_dir_bytes": final,
        "reported_bytes": last["prefix_cache_disk_bytes"], "block_file_bytes": peak["block"],
        "canary_s_before": round(canary_before, 4), "canary_s_after": round(canary_after, 4),
    })  # fmt: skip
    slack = 4 * max(peak["block"], largest)
    if statuses.count(200) != len(statuses):
        return f"statuses {sorted(set(statuses))}: {len(statuses) - statuses.count(200)} not 200"
    if grew("prefix_cache_disk_evictions") <= 0:
        return "no block file evicted: raise --churn-prefixes or lower the budget"
    if final > budget:
        return f"the block files take {final} B after the run, over the budget {budget:.0f} B"
    if peak["bytes"] > budget + slack:
        return f"the block files took {peak['bytes']} B, over the budget {budget:.0f} B + {slack}"
    if int(last["prefix_cache_disk_bytes"] or 0) > budget:  # type: ignore[call-overload]
        return f"the server counts {last['prefix_cache_disk_bytes']} B, over the budget"
    if canary_after > ctx.canary_bound * canary_before:
        return f"the canary took {canary_after:.3f} s after the churn, {canary_before:.3f} s before"
    return None


def spoiled(data: bytes, how: str) -> bytes:
    """A block file's bytes spoiled one way: cut short, a byte flipped, emptied, garbage, or
    re-encoded whole (a right checksum) under another fingerprint."""
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "flipped":
        half = len(data) // 2
        return data[:half] + bytes([data[half] ^ 1]) + data[half + 1 :]
    if how == "empty":
        return b""
    if how == "garbage":
        return b"not a block " * (len(data) // 12)
    import numpy as np

    from probserve.engine.core.disk_cache import MAGIC, encode

    n = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    at = len(MAGIC) + 4
    header = json.loads(data[at : at + n])
    at += n
    arrays = {}
    for name, dtype, shape in header["tensors"]:
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(data, dtype, count, at).reshape(shape)
        at += count * np.dtype(dtype).itemsize
    other = "fp_" + format(int(header["fingerprint"][3:], 16) ^ 1, "016x")
    return encode(other, bytes.fromhex(header["hash"]), tuple(header["tokens"]), arrays)


SPOILS = ["truncated", "flipped", "empty", "garbage", "another_fingerprint"]


def prefix_disk_garbage(ctx: Ctx) -> str | None:
    """Prompts answered (their numbers kept), pushed out of memory onto disk by others, their
    block files then spoiled in place (one way a prompt: SPOILS) and the prompts sent again: each
    answers 200 with the same bits, the server counts a skipped file for each (its first block's:
    refused, deleted, the blocks computed) and reads back none of them."""
    from probserve.engine.core.disk_cache import SUFFIX
    from probserve.engine.prefix_hash import block_hash

    setup = disk_setup(ctx)
    if isinstance(setup, str):
        return setup
    root, _, first = setup
    size = int(first["block_size"])  # type: ignore[call-overload]
    folder = root / str(first["system_fingerprint"])
    salt = secrets.randbelow(900 * 900)
    targets = [distinct_prompt(i, salt, 2 * size + 1) for i in range(len(SPOILS))]

    def files(prompt: list[int]) -> list[Path]:
        out, parent = [], None
        for b in range(len(prompt) // size):
            parent = block_hash(parent, prompt[b * size : (b + 1) * size])
            out.append(folder / parent.hex()[:2] / (parent.hex() + SUFFIX))
        return out

    def ask(prompt: list[int]) -> tuple[int, object]:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True}
        r = ctx.client.post("/v1/completions", json=body)
        return r.status_code, r.json().get("choices")

    before = [ask(p) for p in targets]
    if any(status != 200 for status, _ in before):
        return f"statuses before: {[status for status, _ in before]}"
    wanted = [f for p in targets for f in files(p)]
    fillers = 0
    deadline = time.monotonic() + 300
    while not all(f.is_file() for f in wanted):  # other prompts evict them from memory
        if fillers >= 2000 or time.monotonic() > deadline:
            on_disk = sum(f.is_file() for f in wanted)
            return (f"{on_disk} of {len(wanted)} target blocks on disk after {fillers} other "
                    "prompts: start the server with --prefix-cache-gib 0")  # fmt: skip
        filler = distinct_prompt(len(SPOILS) + fillers, salt, 2 * size + 1)
        ctx.client.post("/v1/completions", json={"prompt": filler, "max_tokens": 1})
        fillers += 1
    settled = settled_disk(ctx.client)
    for prompt, how in zip(targets, SPOILS, strict=True):
        for path in files(prompt):
            tmp = path.with_name(f".spoil-{path.name}")
            tmp.write_bytes(spoiled(path.read_bytes(), how))
            os.replace(tmp, path)
    after = [ask(p) for p in targets]
    last = disk_figures(ctx.client)
    skipped = int(last["prefix_cache_disk_skipped"]) - int(settled["prefix_cache_disk_skipped"])  # type: ignore[call-overload]
    hits = int(last["prefix_cache_disk_hits"]) - int(settled["prefix_cache_disk_hits"])  # type: ignore[call-overload]
    ctx.figures.update({"spoiled_files": len(wanted), "fillers": fillers, "skipped": skipped,
                        "hits": hits, "spoils": SPOILS})  # fmt: skip
    for how, (status, choices), (_, cold) in zip(SPOILS, after, before, strict=True):
        if status != 200 or choices != cold:
            return f"{how}: status {status}, the same numbers: {choices == cold}"
    if skipped < len(SPOILS):
        return f"{skipped} files skipped, {len(SPOILS)} spoiled prompts asked"
    return f"{hits} blocks read back from spoiled files" if hits else None


CASES: list[tuple[str, Callable[[Ctx], str | None]]] = [
    ("huge_seeds", huge_seeds),
    ("long_id_prompts", long_id_prompts),
    ("client_templates", client_templates),
    ("cached_prompt_scoring", cached_prompt_scoring),
    ("lone_surrogates", lone_surrogates),
    ("tiny_temperature", tiny_temperature),
    ("non_finite_and_huge_numbers", non_finite_and_huge_numbers),
    ("deep_nesting", deep_nesting),
    ("big_tokenize", big_tokenize),
    ("disconnects", disconnects),
    ("left_streams", left_streams),
    ("unbudgeted_probe", unbudgeted_probe),
    ("hog_the_batch", hog_the_batch),
    ("embedding_flood", embedding_flood),
    ("slow_clients", slow_clients),
    ("oversized_chunked_bodies", oversized_chunked_bodies),
    ("logprobs_extensions", logprobs_extensions),
    ("forged_log_lines", forged_log_lines),
    ("wrong_typed_lists", wrong_typed_lists),
    ("score_counts_first", score_counts_first),
    ("big_distributions", big_distributions),
    ("slow_distribution_readers", slow_distribution_readers),
    ("big_logprobs_answers", big_logprobs_answers),
    ("deep_json_texts", deep_json_texts),
    ("hostile_grammars", hostile_grammars),
    ("unknown_keys", unknown_keys),
    ("n64_heavy_schema", n64_heavy_schema),
    ("largest_choice", largest_choice),
    ("nested_unknown_keys", nested_unknown_keys),
    ("errors_name_their_field", errors_name_their_field),
    ("booleans_as_numbers", booleans_as_numbers),
    ("two_spellings_disagree", two_spellings_disagree),
    ("duplicate_call_ids", duplicate_call_ids),
    ("long_prompt_flood", long_prompt_flood),
    ("prefix_disk_churn", prefix_disk_churn),
    ("prefix_disk_garbage", prefix_disk_garbage),
]
# run only where --case names them
OPT_IN = {"long_prompt_flood", "prefix_disk_churn", "prefix_disk_garbage"}


# ---- the harness -------------------------------------------------------------------------------


class HealthWatch:
    """Polls /health on its own connection while a case runs; records the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    c.get("/health")
                except httpx.HTTPError:
                    self.failures += 1
                self.worst = max(self.worst, time.perf_counter() - t)
                self._stop.wait(0.1)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_idle(client: httpx.Client, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        r = client.get("/health")
        h = r.json()
        idle = r.status_code == 200 and h["status"] == "ok"
        idle = idle and h["running"] == h["waiting"] == h["held_caches"] == h["streams"] == 0
        if idle or time.monotonic() > deadline:
            return {**h, "http_status": r.status_code, "idle": idle}
        time.sleep(0.1)


def canary(client: httpx.Client) -> object:
    return client.post("/v1/completions", json=CANARY).json()["choices"]


def run(
    url: str,
    header_timeout: float | None,
    health_bound: float,
    only: list[str],
    flood_tokens: int = 2000,
    kv_budget: float | None = None,
    **disk: object,
) -> int:
    """`disk`: the prefix cache on disk's cases' settings (Ctx's prefix_dir, prefix_budget,
    churn_prefixes, churn_blocks, canary_bound)."""
    failed = 0
    with httpx.Client(base_url=url, timeout=300) as client:
        before = canary(client)
        ctx = Ctx(url, client, header_timeout, flood_tokens, kv_budget, **disk)  # type: ignore[arg-type]
        for name, case in CASES:
            if name not in only:
                continue
            ctx.figures.clear()
            started = time.perf_counter()
            with HealthWatch(url) as watch:
                try:
                    problem = case(ctx)
                except Exception as exc:  # a case that crashed is a failed case
                    problem = f"{type(exc).__name__}: {exc}"
            health = wait_idle(client)
            same = canary(client) == before
            ok = (
                problem is None
                and same
                and health["idle"]
                and watch.worst <= health_bound
                and not watch.failures
            )
            failed += not ok
            print(
                json.dumps(
                    {
                        "case": name,
                        "ok": ok,
                        "problem": problem,
                        "canary_same": same,
                        "health_worst_s": round(watch.worst, 3),
                        "health_after": health,
                        "seconds": round(time.perf_counter() - started, 1),
                        **({"figures": dict(ctx.figures)} if ctx.figures else {}),
                    }
                ),
                flush=True,
            )
    print(json.dumps({"cases": len(only), "failed": failed}))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default=None, help="an already running server")
    ap.add_argument("--start", action="store_true", help="start probserve serve for the run")
    ap.add_argument("--port", type=int, default=8013)
    ap.add_argument("--health-bound", type=float, default=1.0, help="slowest /health allowed (s)")
    ap.add_argument("--case", action="append", default=[], help="run only these cases")
    ap.add_argument("--skip", action="append", default=[], help="run every case but these")
    ap.add_argument("--flood-tokens", type=int, default=2000, help="long_prompt_flood's prompts")
    ap.add_argument(
        "--kv-budget-gib",
        type=float,
        default=None,
        help="the server's --kv-cache-gib (0.5 with --start): long_prompt_flood holds it to it",
    )
    ap.add_argument("--prefix-dir", default=None, help="the server's --prefix-cache-dir")
    ap.add_argument("--prefix-disk-gib", type=float, default=None,
                    help="the server's --prefix-cache-disk-gib")  # fmt: skip
    ap.add_argument("--churn-prefixes", type=int, default=10000, help="prefix_disk_churn's count")
    ap.add_argument("--churn-blocks", type=int, default=4, help="full KV blocks a churn prompt")
    ap.add_argument("--canary-bound", type=float, default=3.0,
                    help="prefix_disk_churn: most canary latency after / before")  # fmt: skip
    args = ap.parse_args(argv)
    names = [name for name, _ in CASES]
    unknown = sorted(set(args.case + args.skip) - set(names))
    if unknown:
        raise SystemExit(f"no such case: {', '.join(unknown)} (cases: {', '.join(names)})")
    # the OPT_IN cases (minutes of prefill, a disk cache) run where --case names them
    only = [n for n in (args.case or names) if n not in args.skip]
    only = [n for n in only if args.case or n not in OPT_IN]
    proc = start_server(args.port, START_ARGS) if args.start else None
    url = f"http://127.0.0.1:{args.port}" if args.start else args.url
    if url is None:
        raise SystemExit("give --url or --start")
    try:
        budget = (
            args.kv_budget_gib if args.kv_budget_gib is not None else (0.5 if args.start else None)
        )
        return run(
            url,
            2.0 if args.start else None,
            args.health_bound,
            only,
            args.flood_tokens,
            None if budget is None else budget * 2**30,
            prefix_dir=args.prefix_dir,
            prefix_budget=None if args.prefix_disk_gib is None else args.prefix_disk_gib * 2**30,
            churn_prefixes=args.churn_prefixes,
            churn_blocks=args.churn_blocks,
            canary_bound=args.canary_bound,
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
