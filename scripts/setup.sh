#!/usr/bin/env bash
# One-shot, idempotent set-up for `make test` / `make demo` on a fresh Debian machine:
# system packages, the local services the tests talk to, and the Python virtualenv.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
need_apt=()
command -v memcached >/dev/null 2>&1 || need_apt+=(memcached)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)  # tests run `perfsleuth replay --curl` output
# The web UI is built with Node.js (v18+) and tested in Debian's Chromium (no browser download).
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Services: PostgreSQL, MariaDB and Redis come with the machine; start any that is down.
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "setup: starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! mysqladmin ping -h 127.0.0.1 --silent 2>/dev/null; then
  echo "setup: starting MariaDB"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "setup: starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
if ! (exec 3<>/dev/tcp/127.0.0.1/11211) 2>/dev/null; then
  echo "setup: starting memcached"
  memcached -d -u root -l 127.0.0.1 -p 11211 || true
fi
for i in $(seq 1 30); do
  pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && mysqladmin ping -h 127.0.0.1 --silent 2>/dev/null && break
  sleep 1
done
# The tests use the database "test" on both servers.
psql -h 127.0.0.1 -U postgres -tc "select 1 from pg_database where datname='test'" 2>/dev/null | grep -q 1 \
  || psql -h 127.0.0.1 -U postgres -c "create database test" >/dev/null 2>&1 || true
mysql -h 127.0.0.1 -u root -e "create database if not exists test" >/dev/null 2>&1 || true

# Python environment (re-installed only when pyproject.toml changes).
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.perfsleuth-installed
# (and when the agent's C accelerator changed: the editable install builds it in place)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
  || [ src/perfsleuth/agent/_speedups.c -nt "$stamp" ]; then
  echo "setup: installing Python packages into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev]'
  touch "$stamp"
fi
# The web UI: npm ci and a build into the package (src/perfsleuth/server/static), only when the
# web sources changed since the last build (a hash of them in the stamp file).
static=src/perfsleuth/server/static
web_hash=$(cd web && find package.json package-lock.json index.html vite.config.ts tsconfig.json src \
  -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
web_stamp=.perfsleuth-web-stamp
if [ ! -f "$static/index.html" ] || [ "$(cat "$web_stamp" 2>/dev/null)" != "$web_hash" ]; then
  echo "setup: building the web UI (npm ci, npm run build)"
  node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
  if [ "$node_major" -lt 20 ]; then
    echo "setup: the web UI's build (Vite) needs Node.js 20 or newer; found $(node -v 2>/dev/null || echo none)" >&2
    exit 1
  fi
  if [ ! -d web/node_modules ] || [ web/package-lock.json -nt web/node_modules/.package-lock.json ]; then
    (cd web && npm ci --no-audit --no-fund --loglevel=error)
  fi
  (cd web && npm run --silent build >/dev/null)
  echo "$web_hash" > "$web_stamp"
fi
echo "setup: ready"
