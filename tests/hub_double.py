"""A local stand-in for the Hugging Face hub: the part of its HTTP API huggingface_hub uses to
list a model repository (`/api/models/ORG/NAME`) and download its files
(`/ORG/NAME/resolve/REV/PATH`: HEAD and GET, ranges for resumed downloads), for repositories
built in the test. It can cut a download partway (once per file) and slow it down, and it
records every request. huggingface_hub reaches it through HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubDouble:
    repos: dict[str, dict[str, Path]] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, range
    cut_after: dict[str, int] = field(default_factory=dict)  # a file's first GET stops there
    bytes_per_second: float = 0.0  # 0: as fast as it goes
    _etags: dict[Path, str] = field(default_factory=dict)

    def add(self, repo: str, files: dict[str, Path]) -> None:
        self.repos[repo] = files

    def etag(self, path: Path) -> str:
        if path not in self._etags:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            self._etags[path] = digest.hexdigest()
        return self._etags[path]

    def ranges(self, name: str) -> list[str]:
        """The Range headers of the GETs of file `name`."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith(name) and r]


def _handler(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self) -> None:
            body = json.dumps({"error": "Repository not found"}).encode()
            self._send(404, body, {"X-Error-Code": "RepoNotFound",
                                   "Content-Type": "application/json"})  # fmt: skip

        def do_HEAD(self) -> None:
            self._route()

        def do_GET(self) -> None:
            self._route()

        def _route(self) -> None:
            path = self.path.split("?", 1)[0]
            hub.requests.append((self.command, path, self.headers.get("Range")))
            info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
            if info:
                return self._info(info[1])
            tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path)
            if tree:
                return self._tree(tree[1])
            got = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            if got:
                return self._file(got[1], got[2])
            return self._not_found()

        def _info(self, repo: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found()
            siblings = [{"rfilename": p, "size": f.stat().st_size} for p, f in files.items()]
            body = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                    "siblings": siblings, "tags": []}  # fmt: skip
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _tree(self, repo: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found()
            entries = [{"type": "file", "path": p, "size": f.stat().st_size, "oid": hub.etag(f)}
                       for p, f in files.items()]  # fmt: skip
            self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

        def _file(self, repo: str, name: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found()
            if name not in files:
                body = b'{"error": "Entry not found"}'
                return self._send(404, body, {"X-Error-Code": "EntryNotFound"})
            path = files[name]
            size = path.stat().st_size
            start = 0
            asked = self.headers.get("Range")
            if asked:
                start = int(re.match(r"bytes=(\d+)-", asked)[1])  # type: ignore[index]
            headers = {
                "X-Repo-Commit": COMMIT,
                "ETag": f'"{hub.etag(path)}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
                "Content-Length": str(size - start),
            }
            status = 200
            if start:
                status = 206
                headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command == "HEAD":
                return
            cut = hub.cut_after.pop(name, None)
            with path.open("rb") as f:
                f.seek(start)
                sent = 0
                begun = time.monotonic()
                while chunk := f.read(1 << 20):
                    if cut is not None and sent + len(chunk) > cut:
                        self.wfile.write(chunk[: cut - sent])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)  # the download stops partway
                        return
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    if hub.bytes_per_second:
                        ahead = sent / hub.bytes_per_second - (time.monotonic() - begun)
                        if ahead > 0:
                            time.sleep(ahead)

    return Handler


@contextmanager
def running_hub(hub: HubDouble) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
