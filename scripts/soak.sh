#!/usr/bin/env bash
# Bounded soak of abx-proxy under mixed load with injected upstream faults, on 127.0.0.1 only.
#
# Usage (from anywhere in the repo):
#   scripts/soak.sh [SECONDS]            default 120
#
# Builds abx-proxy and examples/soak_upstream.rs in release, starts the upstream (TLS,
# HTTP/1.1; every 97th request reset after its head, every 89th a 500, every 101st a body
# cut mid-stream, every 53rd answered after 200 ms) and the proxy in front of it, then
# drives it with wrk (installed from Debian when missing):
#   - keep-alive clients: GET /sandboxes, POST /upload (8 KiB), GET /download (64 KiB), in turn;
#   - the same mix with `Connection: close` (a new client connection per request).
# Phases: warm-up (SECONDS/6, at least 10 s), quiesce, main load (the rest), quiesce. At each
# quiesce point the load has stopped, the upstream has closed its idle connections (so the
# proxy's pool is empty) and the proxy reports no open client connection: the proxy's file
# descriptors and RSS are compared there, like for like. During the load they are sampled
# every 5 s (/proc/PID/fd, VmRSS).
#
# Prints: duration, requests, failures split into fault-caused (matched against the faults
# the upstream counted: 500s carrying X-Soak-Fault, 502 E5001 up to the resets, read errors
# up to the cuts) and other, fd count first/last/max, RSS after warm-up vs end.
# Exits non-zero when the fds grew by more than 10 or RSS by more than 20 % between the two
# quiesce points, when any failure was not caused by a fault, or when the proxy died or
# printed a panic.
#
# Bounded: wrk runs for fixed durations (and is stopped early past MAX_REQUESTS upstream
# requests, default 20 000 000); every wait has a timeout; everything started is stopped on
# exit (trap). Knobs: CONNS=16 CHURN_CONNS=4 SKIP_BUILD=1 (use the binaries already built).
set -euo pipefail

SECONDS_TOTAL=${1:-120}
CONNS=${CONNS:-16}
CHURN_CONNS=${CHURN_CONNS:-4}
MAX_REQUESTS=${MAX_REQUESTS:-20000000}
KEY="sk-soak-0123456789abcdef0123456789abcdef"

case "$SECONDS_TOTAL" in
'' | *[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac
if ((SECONDS_TOTAL < 30)); then
    echo "soak: at least 30 seconds" >&2
    exit 2
fi
WARM=$((SECONDS_TOTAL / 6))
((WARM < 10)) && WARM=10
MAIN=$((SECONDS_TOTAL - WARM))

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d /tmp/abx-soak.XXXXXX)
PIDS=()
LOADS=()
UNREADABLE=0 # consecutive samples whose request count could not be read
COUNT_LOST=0

cleanup() {
    local pid
    for pid in "${LOADS[@]}" "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${LOADS[@]}" "${PIDS[@]}"; do
        timeout 5 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { echo "soak: $*" >&2; }

# ---- tools and binaries -------------------------------------------------------------------
if ! command -v wrk >/dev/null; then
    log "installing wrk"
    "$ROOT/scripts/apt-install.sh" wrk
fi
for tool in curl timeout; do
    command -v "$tool" >/dev/null || { log "$tool is required"; exit 1; }
done
if [[ -z "${SKIP_BUILD:-}" ]]; then
    log "building (release)"
    # Apart: with an example in it, a build takes in the dev-dependencies' features.
    (cd "$ROOT" && cargo build --release --locked --quiet --bin abx-proxy)
    (cd "$ROOT" && cargo build --release --locked --quiet --example soak_upstream)
fi
# Where cargo puts its builds, as cargo resolves it (CARGO_TARGET_DIR and the rest).
TARGET="$("$ROOT/scripts/target-dir.sh")"
PROXY_BIN="$TARGET/release/abx-proxy"
UPSTREAM_BIN="$TARGET/release/examples/soak_upstream"

# Waits (up to $1 seconds) for a line matching $3 in file $2; prints it.
wait_line() {
    local limit=$1 file=$2 pattern=$3 i
    for ((i = 0; i < limit * 10; i++)); do
        if grep -m1 -E "$pattern" "$file" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    log "no line matching '$pattern' in $file within ${limit}s:"
    cat "$file" >&2 || true
    return 1
}

# ---- upstream and proxy -------------------------------------------------------------------
"$UPSTREAM_BIN" "$WORK/ca.pem" >"$WORK/upstream.out" 2>&1 &
PIDS+=($!)
line=$(wait_line 10 "$WORK/upstream.out" '^listening ')
UPSTREAM=$(awk '{print $2}' <<<"$line")
CONTROL=$(awk '{print $4}' <<<"$line")

mkdir -p "$WORK/home/.abx" "$WORK/cwd"
(
    cd "$WORK/cwd"
    exec env -i HOME="$WORK/home" ABX_HOME="$WORK/home/.abx" PATH="$PATH" \
        ABX_SANDBOX_API_KEY="$KEY" RUST_BACKTRACE=1 \
        "$PROXY_BIN" serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
        --sandbox-base-url "$UPSTREAM" --upstream-ca "$WORK/ca.pem" \
        --upstream-timeout 10s --log-level 'warn,abx_proxy::serve=info'
) 2>"$WORK/proxy.err" &
PROXY_PID=$!
PIDS+=("$PROXY_PID")
line=$(wait_line 15 "$WORK/proxy.err" 'abx-proxy listening')
LISTEN=$(grep -oE 'listen=[^ ]+' <<<"$line" | cut -d= -f2)
ADMIN=$(grep -oE 'admin=[^ ]+' <<<"$line" | cut -d= -f2)
curl -fsS --max-time 5 "http://$LISTEN/sandboxes" >/dev/null
log "proxy pid $PROXY_PID on $LISTEN (admin $ADMIN), upstream $UPSTREAM"

alive() { kill -0 "$PROXY_PID" 2>/dev/null; }
fds() { ls "/proc/$PROXY_PID/fd" | wc -l; }
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$PROXY_PID/status"; }
stat_field() { curl -fsS --max-time 5 "$CONTROL/stats" | grep -oE "\"$1\":[0-9]+" | cut -d: -f2; }
open_conns() {
    curl -fsS --max-time 5 "http://$ADMIN/metrics" |
        awk '$1 == "abx_proxy_open_connections" {print $2}'
}

# ---- load ---------------------------------------------------------------------------------
cat >"$WORK/mix.lua" <<'LUA'
-- GET /sandboxes, POST /upload (8 KiB), GET /download (64 KiB) in turn; counts statuses.
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
    n = 0
    ok, fault500, e5001, other = 0, 0, 0, 0
    reqs = {
        wrk.format("GET", "/sandboxes"),
        wrk.format("POST", "/upload", {["Content-Type"] = "application/octet-stream"},
            string.rep("u", 8192)),
        wrk.format("GET", "/download?bytes=65536"),
    }
end
function request()
    n = n + 1
    return reqs[(n % 3) + 1]
end
local function header(h, name)
    return h[name] or h[name:lower()]
end
function response(status, headers, body)
    if status >= 200 and status < 300 then
        ok = ok + 1
    elseif status == 500 and header(headers, "X-Soak-Fault") then
        fault500 = fault500 + 1
    elseif status == 502 and header(headers, "X-Abx-Error") == "E5001" then
        e5001 = e5001 + 1
    else
        other = other + 1
        io.stderr:write("unexpected status " .. status .. "\n")
    end
end
function done(summary, latency, requests)
    local t = {ok = 0, fault500 = 0, e5001 = 0, other = 0}
    for _, thread in ipairs(threads) do
        for k, _ in pairs(t) do t[k] = t[k] + thread:get(k) end
    end
    local e = summary.errors
    io.write(string.format(
        "RESULT requests=%d ok=%d fault500=%d e5001=%d other_status=%d connect=%d read=%d write=%d timeout=%d p99_ms=%.1f\n",
        summary.requests, t.ok, t.fault500, t.e5001, t.other,
        e.connect, e.read, e.write, e.timeout, latency:percentile(99) / 1000))
end
LUA

# Runs the load for $1 seconds, sampling every 5 s into samples.txt; stops early past
# MAX_REQUESTS upstream requests.
run_load() {
    local secs=$1 phase=$2 pid i served
    LOADS=()
    UNREADABLE=0
    wrk -t1 -c"$CONNS" -d"${secs}s" --timeout 10s -s "$WORK/mix.lua" \
        "http://$LISTEN" >"$WORK/wrk-$phase-keepalive.out" 2>"$WORK/wrk-$phase-keepalive.err" &
    LOADS+=($!)
    wrk -t1 -c"$CHURN_CONNS" -d"${secs}s" --timeout 10s -s "$WORK/mix.lua" \
        -H "Connection: close" \
        "http://$LISTEN" >"$WORK/wrk-$phase-churn.out" 2>"$WORK/wrk-$phase-churn.err" &
    LOADS+=($!)
    for ((i = 0; i < secs + 30; i += 5)); do
        local running=0
        for pid in "${LOADS[@]}"; do
            kill -0 "$pid" 2>/dev/null && running=1
        done
        ((running)) || break
        alive || { log "the proxy died"; return 1; }
        echo "$phase $(date +%s) $(fds) $(rss_kb)" >>"$WORK/samples.txt"
        # A count unreadable three times running stops the load too, and fails the soak:
        # the bound must hold, and a load cut short is no pass.
        served="$(stat_field requests || true)"
        if [ -z "$served" ]; then
            UNREADABLE=$((UNREADABLE + 1))
        else
            UNREADABLE=0
        fi
        if ((UNREADABLE >= 3)); then
            log "the upstream's request count could not be read; stopping the load"
            COUNT_LOST=1
            kill -INT "${LOADS[@]}" 2>/dev/null || true
        elif [ -n "$served" ] && ((served > MAX_REQUESTS)); then
            log "MAX_REQUESTS reached; stopping the load"
            kill -INT "${LOADS[@]}" 2>/dev/null || true
        fi
        sleep 5
    done
    for pid in "${LOADS[@]}"; do
        timeout 30 tail --pid="$pid" -f /dev/null || { log "wrk did not stop"; return 1; }
    done
    LOADS=()
}

# The load has stopped: empty the proxy's upstream pool, wait for every connection to go.
quiesce() {
    local i
    curl -fsS --max-time 5 -X POST "$CONTROL/close-idle" >/dev/null
    for ((i = 0; i < 150; i++)); do
        if [[ $(stat_field open) == 0 && $(open_conns) == 0 ]]; then
            return 0
        fi
        sleep 0.1
    done
    log "connections still open after 15 s: upstream $(stat_field open), proxy $(open_conns)"
    return 1
}

START=$(date +%s)
FDS_START=$(fds)
log "warm-up ${WARM}s"
run_load "$WARM" warm
quiesce
FDS_WARM=$(fds)
RSS_WARM=$(rss_kb)
log "main load ${MAIN}s (fds $FDS_WARM, RSS ${RSS_WARM} kB after warm-up)"
run_load "$MAIN" main
quiesce
FDS_END=$(fds)
RSS_END=$(rss_kb)
END=$(date +%s)
alive || { log "the proxy died"; exit 1; }

# ---- report -------------------------------------------------------------------------------
sum() { cat "$WORK"/wrk-*.out | { grep -h '^RESULT' || true; } | { grep -oE " $1=[0-9]+" || true; } | cut -d= -f2 | awk '{s += $1} END {print s + 0}'; }
REQUESTS=$(sum requests)
OK=$(sum ok)
S500=$(sum fault500)
S502=$(sum e5001)
SOTHER=$(sum other_status)
E_CONNECT=$(sum connect)
E_READ=$(sum read)
E_WRITE=$(sum write)
E_TIMEOUT=$(sum timeout)
U_REQUESTS=$(stat_field requests)
U_RESETS=$(stat_field resets)
U_ERRORS=$(stat_field errors)
U_CUTS=$(stat_field cuts)
U_SLOW=$(stat_field slow)

min() { (($1 < $2)) && echo "$1" || echo "$2"; }
F500=$(min "$S500" "$U_ERRORS")
F502=$(min "$S502" "$U_RESETS")
FREAD=$(min "$E_READ" "$U_CUTS")
FAULT=$((F500 + F502 + FREAD))
OTHER=$((S500 - F500 + S502 - F502 + SOTHER + E_READ - FREAD + E_CONNECT + E_WRITE + E_TIMEOUT))

read -r FDS_FIRST FDS_LAST FDS_MAX < <(awk 'NR == 1 {f = $3} {l = $3; if ($3 > m) m = $3} END {print f, l, m}' "$WORK/samples.txt")
RSS_MAX=$(awk '{if ($4 > m) m = $4} END {print m}' "$WORK/samples.txt")
PANICS=$(grep -c 'panicked' "$WORK/proxy.err" || true)

echo "abx-proxy soak"
echo "  duration            $((END - START)) s (warm-up ${WARM} s, main ${MAIN} s)"
echo "  requests            $REQUESTS answered ($OK 2xx); upstream saw $U_REQUESTS"
echo "  injected faults     $U_RESETS resets, $U_ERRORS 500s, $U_CUTS cut bodies, $U_SLOW slow"
echo "  failures            $((FAULT + OTHER)): fault-caused $FAULT (500: $F500, 502 E5001: $F502, cut mid-body: $FREAD), other $OTHER"
echo "  client errors       connect $E_CONNECT, read $E_READ, write $E_WRITE, timeout $E_TIMEOUT, unexpected status $SOTHER"
for f in "$WORK"/wrk-warm-keepalive.out "$WORK"/wrk-warm-churn.out "$WORK"/wrk-main-keepalive.out "$WORK"/wrk-main-churn.out; do
    name=$(basename "$f" .out)
    printf '  %-19s %s\n' "${name#wrk-}" "$(grep -h '^RESULT' "$f" | sed -E 's/^RESULT //; s/ (ok|fault500|e5001|other_status|connect|read|write|timeout)=[0-9]+//g')"
done
echo "  fds                 start $FDS_START; under load first $FDS_FIRST, last $FDS_LAST, max $FDS_MAX; idle after warm-up $FDS_WARM, idle at end $FDS_END"
echo "  RSS                 idle after warm-up ${RSS_WARM} kB, idle at end ${RSS_END} kB, max under load ${RSS_MAX} kB"
echo "  panics in stderr    $PANICS"

STATUS=0
if ((COUNT_LOST)); then
    echo "FAIL: the upstream's request count could not be read: the load was stopped early"
    STATUS=1
fi
if ((FDS_END - FDS_WARM > 10)); then
    echo "FAIL: file descriptors grew by $((FDS_END - FDS_WARM)) after warm-up"
    STATUS=1
fi
if ((RSS_END * 100 > RSS_WARM * 120)); then
    echo "FAIL: RSS grew by more than 20 % after warm-up (${RSS_WARM} -> ${RSS_END} kB)"
    STATUS=1
fi
if ((OTHER > 0)); then
    echo "FAIL: $OTHER failures not caused by an injected fault"
    cat "$WORK"/wrk-*.err >&2 || true
    STATUS=1
fi
if ((PANICS > 0)); then
    echo "FAIL: the proxy panicked"
    grep -A5 panicked "$WORK/proxy.err" >&2 || true
    STATUS=1
fi
if ((FAULT == 0)); then
    echo "FAIL: no injected fault reached a client: the soak tested nothing"
    STATUS=1
fi
((STATUS == 0)) && echo "PASS"
exit "$STATUS"
