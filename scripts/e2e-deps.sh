#!/usr/bin/env bash
# Installs what the end-to-end SDK tests (tests/e2e_sdk.rs) run, idempotently:
#   $E2E_DIR/py-latest   Python venv with the newest `e2b` the tests were checked against
#   $E2E_DIR/py250       Python venv with `e2b==2.50.0` (the pre-/v2 paths)
#   tests/e2e/node_modules   `npm ci` from tests/e2e/package-lock.json (e2b latest + 2.50.0)
# E2E_DIR is $ABX_E2E_DIR, else <repo>/target/e2e. Uses the machine's python3 and npm.
# Quiet on success; fast when already installed (marker files); on failure prints the
# installer's log and exits non-zero. Every install is bounded (`timeout`), so a registry
# that stops answering fails the run instead of hanging it. Safe to run concurrently (flock).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
E2E_DIR="${ABX_E2E_DIR:-$ROOT/target/e2e}"
JS_DIR="$ROOT/tests/e2e"
mkdir -p "$E2E_DIR"

if command -v flock >/dev/null 2>&1; then
    exec 9>"$E2E_DIR/.install.lock"
    flock 9
fi

LOG="$E2E_DIR/install.log"

fail() {
    echo "e2e-deps: $1" >&2
    if [ -s "$LOG" ]; then
        echo "---- $LOG (last 60 lines) ----" >&2
        tail -n 60 "$LOG" >&2
    fi
    exit 1
}

# Finds the package without importing it (importing e2b takes about a second).
HAS_E2B='import importlib.util, sys; sys.exit(importlib.util.find_spec("e2b") is None)'

# venv NAME PIP-SPEC: a venv at $E2E_DIR/NAME with PIP-SPEC installed.
venv() {
    local dir="$E2E_DIR/$1" spec="$2"
    local marker="$dir/.abx-e2e-installed"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$spec" ] \
        && "$dir/bin/python" -c "$HAS_E2B" >/dev/null 2>&1; then
        return 0
    fi
    command -v python3 >/dev/null 2>&1 || fail "python3 not found"
    rm -rf "$dir"
    : >"$LOG"
    python3 -m venv "$dir" >>"$LOG" 2>&1 || fail "python3 -m venv $dir failed"
    timeout -k 10 600 "$dir/bin/python" -m pip install --disable-pip-version-check --no-input -q "$spec" \
        >>"$LOG" 2>&1 || fail "pip install $spec failed (or took over 600 s)"
    "$dir/bin/python" -c 'import e2b' >>"$LOG" 2>&1 || fail "e2b does not import in $dir"
    printf '%s' "$spec" >"$marker"
}

# Pinned, so a new release cannot turn CI red with no change here: 2.63.0 is the release the
# captured wire traffic comes from. Raise it on purpose (the marker makes every machine
# reinstall), as tests/e2e/package.json does for the JS SDK.
venv py-latest e2b==2.63.0
venv py250 e2b==2.50.0

# JS: reinstall when package.json or the lockfile changed since the last install.
command -v npm >/dev/null 2>&1 || fail "npm not found"
[ -f "$JS_DIR/package-lock.json" ] || fail "$JS_DIR/package-lock.json is missing"
want="$(cat "$JS_DIR/package.json" "$JS_DIR/package-lock.json" | sha256sum | cut -d' ' -f1)"
marker="$JS_DIR/node_modules/.abx-e2e-installed"
if [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$want" ] \
    || [ ! -f "$JS_DIR/node_modules/e2b/package.json" ]; then
    : >"$LOG"
    (cd "$JS_DIR" && timeout -k 10 600 npm ci --no-audit --no-fund --loglevel=error) >>"$LOG" 2>&1 \
        || fail "npm ci in $JS_DIR failed (or took over 600 s)"
    printf '%s' "$want" >"$marker"
fi

# ---------------------------------------------------------------------------------------
# OpenSandbox (tests/e2e_opensandbox.rs, tests/e2e/opensandbox_test.py):
#   $E2E_DIR/py-opensandbox   Python venv with the `opensandbox` SDK, pinned to the version
#                             examples/fake_opensandbox.rs was written against.
OPENSANDBOX_SPEC="opensandbox==1.1.1"
HAS_OPENSANDBOX='import importlib.util, sys; sys.exit(importlib.util.find_spec("opensandbox") is None)'

opensandbox_venv() {
    local dir="$E2E_DIR/py-opensandbox" spec="$OPENSANDBOX_SPEC"
    local marker="$dir/.abx-e2e-installed"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$spec" ] \
        && "$dir/bin/python" -c "$HAS_OPENSANDBOX" >/dev/null 2>&1; then
        return 0
    fi
    command -v python3 >/dev/null 2>&1 || fail "python3 not found"
    rm -rf "$dir"
    : >"$LOG"
    python3 -m venv "$dir" >>"$LOG" 2>&1 || fail "python3 -m venv $dir failed"
    timeout -k 10 600 "$dir/bin/python" -m pip install --disable-pip-version-check --no-input -q "$spec" \
        >>"$LOG" 2>&1 || fail "pip install $spec failed (or took over 600 s)"
    "$dir/bin/python" -c 'import opensandbox.sync.sandbox' >>"$LOG" 2>&1 \
        || fail "opensandbox does not import in $dir"
    printf '%s' "$spec" >"$marker"
}

opensandbox_venv
