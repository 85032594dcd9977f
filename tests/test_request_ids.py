"""Request ids and structured logs: X-Request-Id accepted (sanitised, capped) and echoed, the
engine requests' ids begin with it, every log line of the request carries it, and
--log-format json writes the access line's fields as fields."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from probserve.logs import MAX_REQUEST_ID, configure_logging, request_id_from
from probserve.models import LoadedModel

BODY = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def served(tiny: LoadedModel) -> Iterator[tuple[str, list[str]]]:
    """A server over the tiny model, and the ids of the engine requests it was sent."""
    from server_util import running_state

    with running_state(tiny) as (url, state):
        engine = state.models[0].engine
        submitted: list[str] = []
        submit = engine.submit

        async def recording(req):  # type: ignore[no-untyped-def]
            submitted.append(req.request_id)
            return await submit(req)

        engine.submit = recording  # type: ignore[method-assign]
        yield url, submitted


def test_request_id_is_echoed_and_prefixes_the_engine_requests(
    served: tuple[str, list[str]],
) -> None:
    url, submitted = served
    r = httpx.post(f"{url}/v1/completions", json=BODY, headers={"X-Request-Id": "job-7.a:1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "job-7.a:1"
    assert submitted[-1].startswith("job-7.a:1-cmpl-")
    r = httpx.post(f"{url}/v1/completions", json={**BODY, "n": 2},
                   headers={"X-Request-Id": "job-7.a:1"})  # fmt: skip
    assert len(set(submitted[-2:])) == 2  # the same client id twice: engine ids stay distinct


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [
        ("a b\t<script>;", "abscript"),
        ("x" * 500, "x" * MAX_REQUEST_ID),
        ("é ☃!", None),  # nothing safe left: a new id
    ],
)
def test_hostile_request_ids_are_sanitised(
    served: tuple[str, list[str]], sent: str, echoed: str | None
) -> None:
    url, _ = served
    raw = sent.encode("utf-8")
    with httpx.Client() as c:
        r = c.get(f"{url}/health", headers=[(b"X-Request-Id", raw)])
    got = r.headers["x-request-id"]
    assert r.status_code == 200 and len(got) <= MAX_REQUEST_ID
    if echoed is not None:
        assert got == echoed
    else:
        assert len(got) == 32 and int(got, 16) >= 0


def test_without_a_header_each_request_gets_its_own(served: tuple[str, list[str]]) -> None:
    url, _ = served
    ids = {httpx.get(f"{url}/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
    assert request_id_from(None) != request_id_from(None)


def test_json_logs_carry_the_access_fields_and_the_request_id(
    served: tuple[str, list[str]], capsys: pytest.CaptureFixture[str], kept_logging: None
) -> None:
    url, _ = served
    configure_logging("info", "json")
    r = httpx.post(f"{url}/v1/completions", json=BODY, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200
    logging.getLogger("probserve.test").info("outside any request")
    lines = [
        json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")
    ]
    access = [
        x for x in lines if x["logger"] == "probserve.access" and x.get("request_id") == "trace-42"
    ]
    assert len(access) == 1
    line = access[0]
    assert line["method"] == "POST" and line["route"] == "/v1/completions"
    assert line["status"] == 200 and line["model"] == "tiny-llama"
    assert line["prompt_tokens"] >= 1 and line["completion_tokens"] == 2
    assert line["latency_ms"] > 0 and line["level"] == "INFO" and "time" in line
    outside = [x for x in lines if x["logger"] == "probserve.test"]
    assert outside and outside[0]["request_id"] == ""


def test_text_logs_tag_the_request(
    served: tuple[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = served
    with caplog.at_level(logging.INFO, logger="probserve.access"):
        httpx.get(f"{url}/health", headers={"X-Request-Id": "tagged-1"})
    record = next(r for r in caplog.records if r.name == "probserve.access")
    assert "GET /health 200" in record.getMessage()
    from probserve.logs import RequestIdFilter

    RequestIdFilter().filter(record)
    assert record.request_id == "tagged-1" and record.request_tag == " [tagged-1]"  # type: ignore[attr-defined]
