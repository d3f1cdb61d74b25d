#!/usr/bin/env bash
# Profile-guided (PGO) release build of abx-proxy, trained on 127.0.0.1 only.
#
# Usage (from anywhere in the repo; root or sudo for the one-time package installs):
#   scripts/pgo.sh            prints the binary's path last: target/pgo/release/abx-proxy
#
# Why: the proxy's user-space profile is flat (no function over 8 % of its CPU time), so no
# single fix is left that saves much, while PGO lays out and inlines the whole request path
# by how it actually runs. Side by side on the 2-core benchmark machine it served 4-13 %
# more requests per second than the plain build at 0.81-0.94x its CPU time per request in
# most runs (`PGO=1 bash benches/load.sh` measures both builds in one run).
#
# Steps:
#   1. an instrumented build (target/pgo-gen/) and the release examples it trains against;
#   2. training, every part bounded by wrk -d or curl --max-time:
#      - control plane over plain HTTP/1.1 (examples/bench_upstream): small GETs at 8, 64
#        and 256 connections, 256 KiB uploads, 1 MiB downloads;
#      - the E2B paths over TLS (examples/fake_e2b with its own CA): POST /sandboxes
#        (the envd token learnt from the answer), GET /sandboxes/{id} (HTTP/2 upstream),
#        envd GET /health and GET /files routed by `E2b-Sandbox-Id` (HTTP/1.1 over TLS);
#      - a /metrics scrape and a SIGHUP reload;
#      the proxy then stops on SIGTERM, which writes the profile;
#   3. llvm-profdata merges it (the one matching rustc's LLVM: rustup's `llvm-tools`
#      component, else Debian's `llvm-N`, installed when missing);
#   4. the release build with the profile (target/pgo/), same sources and Cargo.lock.
# Paths the training does not reach (HTTP/2 or TLS clients, the unix listener, the AK/SK
# exchange) are compiled as cold, placed apart and optimised for size, their speed not
# measured: a path that is hot for you belongs in step 2. The plain `cargo build --release` stays the default
# build; this one takes about twice as long.
# Knobs: TRAIN_SECS=3 (seconds per wrk run), BASE_PORT=27400.
set -euo pipefail

TRAIN_SECS=${TRAIN_SECS:-3}
BASE_PORT=${BASE_PORT:-27400}
KEY="sk-pgo-0123456789abcdef0123456789abcdef"

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d /tmp/abx-pgo.XXXXXX)
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        timeout 5 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { printf '>> %s\n' "$*" >&2; }
die() { printf 'pgo.sh: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- tools
export PATH="$PATH:/usr/sbin:/sbin"
apt_install() {
    log "installing $*"
    "$ROOT/scripts/apt-install.sh" "$@"
}
missing=()
for t in wrk curl python3; do command -v "$t" >/dev/null || missing+=("$t"); done
command -v ss >/dev/null || missing+=(iproute2)
((${#missing[@]} == 0)) || apt_install "${missing[@]}"

# The profile's format follows LLVM's major version: merge with rustc's own.
LLVM_MAJOR=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
HOST=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA="$(rustc --print sysroot)/lib/rustlib/$HOST/bin/llvm-profdata"
# rustup's component matches rustc's LLVM whatever its version; Debian packages only some.
if [[ ! -x $PROFDATA ]] && command -v rustup >/dev/null; then
    log "adding rustup's llvm-tools"
    timeout -k 10 600 rustup component add llvm-tools >/dev/null 2>&1 || true
fi
if [[ ! -x $PROFDATA ]]; then
    PROFDATA=$(command -v "llvm-profdata-$LLVM_MAJOR" || true)
    [[ -n $PROFDATA ]] || apt_install "llvm-$LLVM_MAJOR" ||
        die "no llvm-profdata for LLVM $LLVM_MAJOR: run 'rustup component add llvm-tools' or install llvm-$LLVM_MAJOR"
    PROFDATA=$(command -v "llvm-profdata-$LLVM_MAJOR") || die "llvm-$LLVM_MAJOR has no llvm-profdata-$LLVM_MAJOR"
fi

# RUSTFLAGS with one flag added, as cargo's unsplit form: a checkout path with a space in it
# would be cut in two by RUSTFLAGS's splitting on spaces.
rustflags_with() {
    local flags=()
    read -ra flags <<<"${RUSTFLAGS:-}"
    flags+=("$1")
    (IFS=$'\x1f' && printf '%s' "${flags[*]}")
}

# ---------------------------------------------------------------- 1. instrumented build
PROFILE_DIR="$ROOT/target/pgo-profile"
rm -rf "$PROFILE_DIR"
log "instrumented build (target/pgo-gen)"
(cd "$ROOT" && CARGO_ENCODED_RUSTFLAGS="$(rustflags_with "-Cprofile-generate=$PROFILE_DIR")" CARGO_TARGET_DIR="$ROOT/target/pgo-gen" \
    cargo build --release --locked --bin abx-proxy)
(cd "$ROOT" && cargo build --release --locked --example bench_upstream --example fake_e2b)
GEN="$ROOT/target/pgo-gen/release/abx-proxy"
# Where cargo puts its builds, as cargo resolves it (CARGO_TARGET_DIR and the rest).
TARGET="$("$ROOT/scripts/target-dir.sh")"
EXAMPLES="$TARGET/release/examples"

# ---------------------------------------------------------------- 2. training
for p in $(seq "$BASE_PORT" $((BASE_PORT + 5))); do
    if ss -Hltn "sport = :$p" | grep -q .; then die "port $p is in use (set BASE_PORT)"; fi
done
wait_http() { # url [curl args...]
    local i url=$1
    shift
    for i in $(seq 100); do
        if curl -s -o /dev/null --max-time 1 "$@" "$url"; then return 0; fi
        sleep 0.1
    done
    return 1
}
PROXY_PID=
start_proxy() { # port upstream-args...
    local port=$1
    shift
    mkdir -p "$WORK/home"
    (
        cd "$WORK"
        for v in $(compgen -e | grep '^ABX_' || true); do unset "$v"; done
        export ABX_HOME="$WORK/home" ABX_SANDBOX_API_KEY="$KEY"
        exec "$GEN" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$((port + 1))" "$@" 2>/dev/null
    ) &
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    wait_http "http://127.0.0.1:$((port + 1))/healthz" || die "the instrumented proxy did not start"
}
# SIGTERM drains and exits normally, which is when the profile is written.
stop_proxy() {
    kill -TERM "$PROXY_PID"
    timeout 30 tail --pid="$PROXY_PID" -f /dev/null || die "the instrumented proxy did not stop"
}
load() { # conns url [wrk args...]
    local c=$1 url=$2
    shift 2
    timeout $((TRAIN_SECS + 20)) wrk -t2 -c"$c" -d"${TRAIN_SECS}s" "$@" "$url" >"$WORK/wrk.out" 2>&1 ||
        die "wrk $url: $(head -c 300 "$WORK/wrk.out")"
    grep -q 'Non-2xx' "$WORK/wrk.out" && die "wrk $url: errors: $(cat "$WORK/wrk.out")"
    log "  $(awk '/requests in/ {print $1}' "$WORK/wrk.out") requests: $url (c=$c)"
}
cat >"$WORK/upload.lua" <<'EOF'
wrk.method = "POST"
wrk.body = string.rep("x", 256 * 1024)
wrk.headers["Content-Type"] = "application/octet-stream"
EOF

log "training: plain HTTP/1.1 upstream"
P_UP=$BASE_PORT P_PROXY=$((BASE_PORT + 2))
"$EXAMPLES/bench_upstream" "127.0.0.1:$P_UP" >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$P_UP/bench" || die "bench_upstream did not start"
start_proxy "$P_PROXY" --sandbox-base-url "http://127.0.0.1:$P_UP"
for c in 8 64 256; do load "$c" "http://127.0.0.1:$P_PROXY/bench" -H 'X-API-Key: dummy'; done
load 8 "http://127.0.0.1:$P_PROXY/upload" -H 'X-API-Key: dummy' -s "$WORK/upload.lua"
load 8 "http://127.0.0.1:$P_PROXY/download?bytes=1048576" -H 'X-API-Key: dummy'
curl -sf --max-time 5 -o /dev/null "http://127.0.0.1:$((P_PROXY + 1))/metrics" || die "no /metrics"
kill -HUP "$PROXY_PID"
wait_http "http://127.0.0.1:$P_PROXY/bench" -H 'X-API-Key: dummy' || die "no answer after SIGHUP"
stop_proxy

log "training: the E2B paths over TLS"
P_PROXY=$((BASE_PORT + 4))
"$EXAMPLES/fake_e2b" --expect-key "$KEY" --dummy-key dummy --tls-ca-out "$WORK/ca.pem" >"$WORK/fake.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -s $WORK/fake.out ]] && break; sleep 0.1; done
read -r TLS_API DOMAIN < <(python3 -c 'import json, sys
d = json.loads(open(sys.argv[1]).readline())
print(d["tls_api"], d["sandbox_domain"])' "$WORK/fake.out") || die "fake_e2b did not start: $(cat "$WORK/fake.out")"
start_proxy "$P_PROXY" --sandbox-base-url "$TLS_API" --sandbox-domain "$DOMAIN" --upstream-ca "$WORK/ca.pem"
ID=$(curl -sf --max-time 10 -X POST -H 'X-API-Key: dummy' -H 'Content-Type: application/json' \
    -d '{"templateID":"base"}' "http://127.0.0.1:$P_PROXY/sandboxes" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["sandboxID"])') || die "POST /sandboxes failed"
ENVD=(-H "E2b-Sandbox-Id: $ID" -H 'E2b-Sandbox-Port: 49983')
load 64 "http://127.0.0.1:$P_PROXY/sandboxes/$ID" -H 'X-API-Key: dummy'
load 64 "http://127.0.0.1:$P_PROXY/health" "${ENVD[@]}"
# A missing file is a 404 from envd: forwarded like any answer, so not counted as an error.
timeout $((TRAIN_SECS + 20)) wrk -t2 -c8 -d"${TRAIN_SECS}s" "${ENVD[@]}" \
    "http://127.0.0.1:$P_PROXY/files?path=/home/user/missing" >/dev/null 2>&1 || die "wrk /files failed"
stop_proxy

# ---------------------------------------------------------------- 3-4. merge, build
shopt -s nullglob
raw=("$PROFILE_DIR"/*.profraw)
((${#raw[@]})) || die "the training wrote no profile to $PROFILE_DIR"
"$PROFDATA" merge -o "$PROFILE_DIR/merged.profdata" "${raw[@]}"
log "optimised build with the profile (target/pgo)"
(cd "$ROOT" && CARGO_ENCODED_RUSTFLAGS="$(rustflags_with "-Cprofile-use=$PROFILE_DIR/merged.profdata")" CARGO_TARGET_DIR="$ROOT/target/pgo" \
    cargo build --release --locked --bin abx-proxy)
echo "$ROOT/target/pgo/release/abx-proxy"
