#!/usr/bin/env bash
# Installs what the end-to-end SDK tests (tests/e2e_sdk.rs, tests/e2e_opensandbox.rs) run,
# idempotently, every package pinned (tests/e2e/python/*.txt, tests/e2e/package-lock.json):
#   $E2E_DIR/py-latest       Python venv with `e2b==2.64.0`, the newest the tests were checked against,
#                            and `e2b-code-interpreter==2.11.5`
#   $E2E_DIR/py250           Python venv with `e2b==2.50.0` (the pre-/v2 paths)
#   $E2E_DIR/py220           Python venv with `e2b==2.20.0` (token-only envd requests)
#   $E2E_DIR/py-opensandbox  Python venv with the `opensandbox` SDK (1.2.1)
#   tests/e2e/node_modules   `npm ci` from tests/e2e/package-lock.json (e2b 2.51.0 + 2.50.0,
#                            @e2b/code-interpreter 2.8.0)
# E2E_DIR is $ABX_E2E_DIR, else e2e/ in cargo's target directory (scripts/target-dir.sh).
# Uses the machine's python3 and npm (Node.js 20.18.1 or newer). Quiet on success; fast when already installed (a marker per
# install, and every file the installed packages list still there); on failure prints the
# installer's log and exits non-zero. Every install is bounded (`timeout`), so a registry
# that stops answering fails the run instead of hanging it. Safe to run concurrently (flock).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
E2E_DIR="${ABX_E2E_DIR:-$("$ROOT/scripts/target-dir.sh")/e2e}"
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

# The venv holds exactly the pinned packages (pip's own aside), and every file they list
# is there: a package removed or upgraded by hand, or files deleted, and the venv is
# installed again. Reads metadata and stats files, without importing anything (importing
# e2b takes about a second); `-I` keeps the caller's PYTHONPATH and directory out of it.
INTACT='
import importlib.metadata as md, os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        pins[norm(name)] = version
found = {}
for d in md.distributions():
    if norm(d.name) in ("pip", "setuptools", "wheel"):
        continue
    found[norm(d.name)] = d.version
    for f in d.files or ():
        if "__pycache__" not in f.parts and not os.path.exists(d.locate_file(f)):
            sys.exit(f"{d.name}: {f} is missing")
if found != pins:
    sys.exit(f"installed {sorted(found.items())}, pinned {sorted(pins.items())}")
'

# venv NAME MODULE: a venv at $E2E_DIR/NAME with tests/e2e/python/NAME.txt installed, and
# MODULE importing there.
venv() {
    local dir="$E2E_DIR/$1" module="$2" pins="$ROOT/tests/e2e/python/$1.txt"
    local marker="$dir/.abx-e2e-installed" want
    want="$(sha256sum "$pins" | cut -d' ' -f1)"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ] \
        && "$dir/bin/python" -I -c "$INTACT" "$pins" >/dev/null 2>&1; then
        return 0
    fi
    command -v python3 >/dev/null 2>&1 || fail "python3 not found"
    : >"$LOG"
    # Else pip's resolver says it, at length, of the first package that needs it.
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || fail "Python $(python3 -c 'import platform; print(platform.python_version())') is too old: the pinned SDKs need 3.11 or newer"
    rm -rf "$dir"
    python3 -m venv "$dir" >>"$LOG" 2>&1 || fail "python3 -m venv $dir failed"
    timeout -k 10 600 "$dir/bin/python" -m pip install --disable-pip-version-check --no-input -q \
        -r "$pins" >>"$LOG" 2>&1 || fail "pip install -r $pins failed (or took over 600 s)"
    "$dir/bin/python" -c "import $module" >>"$LOG" 2>&1 || fail "$module does not import in $dir"
    printf '%s' "$want" >"$marker"
}

# Pinned, so a new release cannot turn CI red with no change here: e2b 2.64.0 is the newest
# checked (the captured wire traffic is 2.63.0's), e2b-code-interpreter 2.11.5 the one the
# fake's code interpreter (examples/fake_e2b.rs) was written against, and opensandbox 1.2.1
# the newest checked (examples/fake_opensandbox.rs was written against 1.1.1). Raise them
# on purpose (the marker makes every machine reinstall), as tests/e2e/package.json does for
# the JS SDK. Python first: a machine without npm still gets the venvs, and the JS step
# says what is missing.
venv py-latest e2b_code_interpreter
venv py250 e2b
venv py220 e2b
venv py-opensandbox opensandbox.sync.sandbox

# JS: reinstall when package.json or the lockfile changed since the last install, or a
# package the lockfile lists is gone from node_modules (its package.json; files deleted
# inside a package are not looked for).
command -v npm >/dev/null 2>&1 || fail "npm not found (Node.js 20.18.1 or newer is needed)"
node -e 'const [a, b, c] = process.versions.node.split(".").map(Number);
  process.exit(a > 20 || (a === 20 && (b > 18 || (b === 18 && c >= 1))) ? 0 : 1)' \
    || fail "Node.js $(node --version) is too old: the e2b SDK needs 20.18.1 or newer"
[ -f "$JS_DIR/package-lock.json" ] || fail "$JS_DIR/package-lock.json is missing"
want="$(cat "$JS_DIR/package.json" "$JS_DIR/package-lock.json" | sha256sum | cut -d' ' -f1)"
marker="$JS_DIR/node_modules/.abx-e2e-installed"
JS_INTACT='const fs = require("fs");
const lock = JSON.parse(fs.readFileSync("package-lock.json", "utf8"));
for (const [path, p] of Object.entries(lock.packages || {})) {
  if (path && !p.optional && !p.dev && !fs.existsSync(path + "/package.json")) process.exit(1);
}'
if [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$want" ] \
    || ! (cd "$JS_DIR" && node -e "$JS_INTACT"); then
    : >"$LOG"
    (cd "$JS_DIR" && timeout -k 10 600 npm ci --no-audit --no-fund --loglevel=error) >>"$LOG" 2>&1 \
        || fail "npm ci in $JS_DIR failed (or took over 600 s)"
    printf '%s' "$want" >"$marker"
fi
