#!/usr/bin/env bash
# What a new user installs is what we test: build the wheel, install it with no extras into a
# new virtualenv (no editable install, no test dependencies), then run the demo, read the
# findings as JSON and load the web UI's page and one of its assets from `perfsleuth ui`.
# Needs the built web UI in the package (scripts/setup.sh builds it) and the project's .venv
# (for `build`).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d /tmp/perfsleuth-wheel.XXXXXX)
ui_pid=
cleanup() {
  [ -n "$ui_pid" ] && kill "$ui_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

[ -f src/perfsleuth/server/static/index.html ] || {
  echo "check-wheel: the web UI is not built (run make setup)" >&2
  exit 1
}

echo "check-wheel: building the wheel"
.venv/bin/python -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
  tail -n 30 "$work/build.log" >&2
  exit 1
}
wheel=$(ls "$work"/dist/perfsleuth-*.whl)
unzip -l "$wheel" | grep -q 'perfsleuth/server/static/index.html' || {
  echo "check-wheel: $wheel does not carry the web UI" >&2
  exit 1
}

echo "check-wheel: installing $(basename "$wheel") into a new venv (no extras)"
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip "$wheel" >"$work/pip.log" 2>&1 || {
  cat "$work/pip.log" >&2
  exit 1
}
ps="$work/venv/bin/perfsleuth"

cd "$work"  # away from the source tree: only the installed package can be imported
echo "check-wheel: perfsleuth demo --no-ui"
"$ps" demo --no-ui --seconds 10 --data "$work/demo" >"$work/demo.log" 2>&1 || {
  tail -n 40 "$work/demo.log" >&2
  exit 1
}

echo "check-wheel: perfsleuth findings --json"
"$ps" findings --json --data "$work/demo" >"$work/findings.json"
"$work/venv/bin/python" - "$work/findings.json" <<'EOF'
import json, sys
findings = json.load(open(sys.argv[1]))
if not isinstance(findings, list) or not findings:
    sys.exit(f"check-wheel: findings --json gave no findings: {str(findings)[:200]}")
print(f"check-wheel: {len(findings)} findings, kinds {sorted({f['kind'] for f in findings})}")
EOF

echo "check-wheel: perfsleuth ui"
port=$("$work/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$ps" ui --data "$work/demo" --port "$port" --no-ingest >"$work/ui.log" 2>&1 &
ui_pid=$!
page=
for _ in $(seq 1 60); do
  page=$(curl -fsS "http://127.0.0.1:$port/" 2>/dev/null) && break
  sleep 0.5
done
echo "$page" | grep -q '<title>perfsleuth</title>' || {
  echo "check-wheel: the UI page did not load" >&2
  cat "$work/ui.log" >&2
  exit 1
}
asset=$(echo "$page" | grep -o 'assets/[^"]*\.js' | head -n1)
[ -n "$asset" ] && curl -fsS "http://127.0.0.1:$port/$asset" >/dev/null || {
  echo "check-wheel: the UI's script ($asset) did not load" >&2
  exit 1
}
curl -fsS "http://127.0.0.1:$port/api/status" >/dev/null
echo "check-wheel: ok (page, $asset and /api/status served from the installed wheel)"
