"""The HTTP edge as a browser UI and an operator meet it: CORS for allowed origins (a preflight
answered before auth), HTTPS with a certificate made here."""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from probserve.api.app import create_app
from probserve.api.edge.server import uvicorn_config
from probserve.cli import main
from probserve.models import LoadedModel
from probserve.serving import build_state

ORIGIN = "https://ui.example"


def test_cors_preflight_from_an_allowed_origin_before_auth(tiny: LoadedModel) -> None:
    from server_util import running_server

    with running_server(tiny, "--allowed-origins", ORIGIN, "--api-key", "k1") as url:
        preflight = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        r = httpx.options(f"{url}/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        other = httpx.options(f"{url}/v1/completions", headers={**preflight, "Origin": "https://x"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1}
        no_key = httpx.post(f"{url}/v1/completions", json=body, headers={"Origin": ORIGIN})
        assert no_key.status_code == 401  # the key is still needed for the call itself
        assert no_key.headers["access-control-allow-origin"] == ORIGIN  # and the page can read why
        ok = httpx.post(
            f"{url}/v1/completions",
            json=body,
            headers={"Origin": ORIGIN, "Authorization": "Bearer k1"},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        # Anthropic's SDK and Claude Code send the key as x-api-key; its errors are Anthropic's
        hi = [{"role": "user", "content": "Hi"}]
        message = {"model": "tiny-llama", "max_tokens": 1, "messages": hi}
        for key, status in (("k1", 200), ("k2", 401), (None, 401)):
            headers = {"x-api-key": key} if key else {}
            r = httpx.post(f"{url}/v1/messages", json=message, headers=headers, timeout=60)
            assert r.status_code == status, r.text
        refused = r.json()
        assert refused["type"] == "error" and refused["error"]["type"] == "authentication_error"


def test_no_cors_unless_asked(tiny: LoadedModel) -> None:
    from server_util import running_server

    with running_server(tiny) as url:
        r = httpx.options(
            f"{url}/v1/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in r.headers


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_https_with_a_self_signed_certificate(tiny: LoadedModel, tmp_path: Path) -> None:
    from server_util import free_port, serve_settings

    key, cert = _self_signed(tmp_path)
    state, supervisor = build_state(serve_settings("--worker", "inline"), tiny)
    port = free_port()
    config = uvicorn_config(create_app(state), state.config.http, "127.0.0.1", port, str(key),
                            str(cert))  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "no HTTPS server"
            time.sleep(0.02)
        r = httpx.get(f"https://127.0.0.1:{port}/health", verify=str(cert))
        assert r.status_code == 200 and r.json()["status"] == "ok"
        with pytest.raises(httpx.ConnectError):  # a client that does not trust it refuses
            httpx.get(f"https://127.0.0.1:{port}/health")
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        supervisor.stop()
        server.should_exit = True
        thread.join(timeout=30)
        supervisor.close()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ssl-keyfile", "k.pem"], "go together"),
        (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ray"], "--ray"),
    ],
)
def test_tls_flags_that_do_not_go_together(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str], kept_logging: None
) -> None:
    assert main(["serve", *flags]) == 2
    assert says in capsys.readouterr().err


def test_sse_keepalive_comments_through_silence() -> None:
    import asyncio

    from probserve.api.edge.sse import KEEPALIVE, with_keepalive

    async def slow() -> AsyncIterator[str]:
        for i in range(3):
            await asyncio.sleep(0.35)
            yield f"data: {i}\n\n"

    async def collect(seconds: float) -> list[str]:
        return [item async for item in with_keepalive(slow(), seconds)]

    got = asyncio.run(collect(0.1))
    assert [x for x in got if x != KEEPALIVE] == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert got.count(KEEPALIVE) >= 6  # about three a gap
    assert asyncio.run(collect(0)) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]

    async def leave_early() -> None:
        stream = with_keepalive(slow(), 0.1)
        assert await anext(stream) == KEEPALIVE
        await stream.aclose()  # the client went away: the pending read is cancelled
        await asyncio.sleep(0)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(leave_early())


def test_a_busy_port_fails_before_any_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kept_logging: None
) -> None:
    import socket

    import probserve.serving

    def no_load(*_: object) -> None:
        raise AssertionError("the models were loaded before the port was bound")

    monkeypatch.setattr(probserve.serving, "build_state", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err
