#!/usr/bin/env bash
# Load test: abx-proxy against nginx and HAProxy configured the same way, on 127.0.0.1 only.
#
# Usage (as yourself, from anywhere in the repo; missing packages are installed through
# `sudo -n` unless run as root, and 10 000 idle connections need an open-file hard limit
# of 20 256 plus four per core: abx-proxy counts two descriptors per client connection):
#   bash benches/load.sh
#
# One run installs what is missing (nginx, haproxy, wrk, curl, python3 from Debian's
# packages), builds abx-proxy and examples/bench_upstream.rs in release, starts the upstream,
# nginx with 1 and with 2 workers, HAProxy and abx-proxy (and its PGO build, with PGO=1), then:
#   1. request rate: wrk (2 threads, `--latency`) at 8, 64 and 256 connections, DUR seconds
#      a run, ROUNDS rounds, the targets interleaved (order rotated every round);
#      per run the proxy's peak RSS (VmHWM reset before the run via /proc/PID/clear_refs,
#      summed over nginx's master and workers; VmRSS polling where clear_refs is refused)
#      and its CPU time per request (user + system, from /proc/PID/stat);
#   2. transfers: XFER_BYTES (1 GiB) downloaded and uploaded through every proxy and direct,
#      with curl to /dev/null and from a generator (`head -c … /dev/zero`), XFER_ROUNDS
#      rounds interleaved: throughput (median) and the proxy's peak RSS (highest);
#   3. IDLE_CONNS (10 000) idle keep-alive connections (one request each, then held open)
#      against abx-proxy (and nginx 1 worker, for reference): the proxy's RSS.
# and prints Markdown tables: medians per target and connection count, the ratio to the
# best nginx configuration at that count; the transfer table; the idle-connection lines.
#
# Every proxy is configured equivalently: forward to the upstream, `Authorization: Bearer
# <key>` attached, `X-API-Key` removed, `Host` set to the upstream's, keep-alive to the
# upstream (reusing any idle connection), no request or response buffering, one access-log
# line per request written to /dev/null (abx-proxy logs every request at info; the others
# are made to do the same work). The headers each proxy sends are checked before measuring.
#
# Knobs (environment): DUR=5 ROUNDS=3 CONNS="8 64 256" XFER_BYTES=1073741824 XFER_ROUNDS=3
#   IDLE_CONNS=10000 BASE_PORT=27100 SKIP_BUILD=1 (use the binaries already built)
#   ABX_EXTRA_ARGS="…" (extra flags for `abx-proxy serve`)
#   PARTS="rate xfer idle" (which of the three parts to run; the report covers those run)
#   PGO=1 (also build abx-proxy with scripts/pgo.sh, about 6 minutes more, and measure that
#   build beside the plain release one as the target abx-pgo; with SKIP_BUILD=1, the one
#   already in target/pgo/).
# Every run is bounded (wrk -d, curl --max-time, timeouts on every wait), stops by itself
# and kills what it started on exit. Expect 8 to 10 minutes after the build. Not part of the
# test suite.
set -euo pipefail

DUR=${DUR:-5}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-"8 64 256"}
XFER_BYTES=${XFER_BYTES:-1073741824}
XFER_ROUNDS=${XFER_ROUNDS:-3}
IDLE_CONNS=${IDLE_CONNS:-10000}
BASE_PORT=${BASE_PORT:-27100}
PARTS=${PARTS:-"rate xfer idle"}
part() { [[ " $PARTS " == *" $1 "* ]]; }
KEY="sk-bench-0123456789abcdef0123456789abcdef"

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d /tmp/abx-load.XXXXXX)
PIDS=()

cleanup() {
    local pid
    if [[ -s $WORK/idle.pid ]]; then kill "$(cat "$WORK/idle.pid")" 2>/dev/null || true; fi
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        # nginx's master takes its workers down with it; give everyone a moment.
        timeout 5 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { printf '>> %s\n' "$*" >&2; }
die() { printf 'load.sh: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- tools and build
export PATH="$PATH:/usr/sbin:/sbin"
missing=()
command -v nginx >/dev/null || missing+=(nginx)
command -v haproxy >/dev/null || missing+=(haproxy)
command -v wrk >/dev/null || missing+=(wrk)
command -v curl >/dev/null || missing+=(curl)
command -v python3 >/dev/null || missing+=(python3)
# The port check, and nginx's workers counted with their master (RSS, CPU time).
command -v ss >/dev/null || missing+=(iproute2)
command -v pgrep >/dev/null || missing+=(procps)
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    "$ROOT/scripts/apt-install.sh" "${missing[@]}"
    SUDO=()
    [[ $(id -u) -eq 0 ]] || SUDO=(sudo -n)
    # The packages also start nginx's default site (port 80 on every interface) and
    # HAProxy's service, through systemd or, where there is none (sysvinit, LXC, WSL),
    # their init scripts, and enable them at boot: the runs below start their own on
    # 127.0.0.1.
    for unit in nginx haproxy; do
        [[ " ${missing[*]} " == *" $unit "* ]] || continue
        if [[ -d /run/systemd/system ]]; then
            timeout -k 10 60 "${SUDO[@]}" systemctl disable --now "$unit" >/dev/null 2>&1 || true
        else
            timeout -k 10 60 "${SUDO[@]}" invoke-rc.d "$unit" stop >/dev/null 2>&1 || true
            timeout -k 10 60 "${SUDO[@]}" update-rc.d "$unit" disable >/dev/null 2>&1 || true
        fi
        log "$unit was installed for this benchmark: its system service is stopped and disabled"
    done
fi

if [[ -z ${SKIP_BUILD:-} ]]; then
    log "cargo build --release --locked"
    # Two builds: one that takes in an example also takes in the dev-dependencies' features
    # (tokio's multi-thread scheduler), and is not the binary users run.
    (cd "$ROOT" && cargo build --release --locked --bin abx-proxy)
    (cd "$ROOT" && cargo build --release --locked --example bench_upstream)
    if [[ -n ${PGO:-} ]]; then
        log "scripts/pgo.sh (instrumented build, training, build with the profile)"
        bash "$ROOT/scripts/pgo.sh" >/dev/null
    fi
fi
# Where cargo puts its builds, as cargo resolves it (CARGO_TARGET_DIR and the rest).
TARGET="$("$ROOT/scripts/target-dir.sh")"
ABX="$TARGET/release/abx-proxy"
ABX_PGO="$ROOT/target/pgo/release/abx-proxy"
UPSTREAM_BIN="$TARGET/release/examples/bench_upstream"
[[ -x $ABX && -x $UPSTREAM_BIN ]] || die "release binaries missing (build failed?)"
[[ -z ${PGO:-} || -x $ABX_PGO ]] || die "PGO build missing (scripts/pgo.sh failed?)"

# 10 000 client sockets plus the proxy's: raise the descriptor limit for everything below.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
(($(ulimit -n) >= IDLE_CONNS + 512)) || {
    log "ulimit -n $(ulimit -n) is too low for $IDLE_CONNS connections; using $(($(ulimit -n) - 512))"
    IDLE_CONNS=$(($(ulimit -n) - 512))
}
# abx-proxy counts two descriptors per client connection (its own and, while a request runs,
# an upstream one), plus a reserve of 256 and four per worker (one per core): under a
# shorter limit it serves fewer at once (its start-up warning says how many) and the rest
# wait in the accept queue, so the idle part holds fewer than asked. nginx and HAProxy count
# one per idle client.
ABX_NEEDS=$((2 * IDLE_CONNS + 256 + 4 * $(nproc)))
(($(ulimit -n) >= ABX_NEEDS)) ||
    log "ulimit -n $(ulimit -n) is below the $ABX_NEEDS abx-proxy needs to serve $IDLE_CONNS connections at once: the idle part will hold fewer (raise the hard limit to measure $IDLE_CONNS)"

P_UP=$BASE_PORT
P_NGX1=$((BASE_PORT + 1))
P_NGX2=$((BASE_PORT + 2))
P_HAP=$((BASE_PORT + 3))
P_ABX=$((BASE_PORT + 4))
P_ADMIN=$((BASE_PORT + 5))
P_PGO=$((BASE_PORT + 6))
P_PGO_ADMIN=$((BASE_PORT + 7))
for p in $P_UP $P_NGX1 $P_NGX2 $P_HAP $P_ABX $P_ADMIN $P_PGO $P_PGO_ADMIN; do
    if ss -Hltn "sport = :$p" | grep -q .; then die "port $p is in use (set BASE_PORT)"; fi
done

# ---------------------------------------------------------------- configurations
nginx_conf() { # workers port dir
    mkdir -p "$3/tmp"
    cat >"$3/nginx.conf" <<EOF
worker_processes $1;
worker_rlimit_nofile $(ulimit -n);
daemon off;
pid $3/nginx.pid;
error_log $3/error.log warn;
events { worker_connections $((IDLE_CONNS + 1024)); }
http {
    access_log /dev/null;
    client_body_temp_path $3/tmp/body;
    proxy_temp_path $3/tmp/proxy;
    fastcgi_temp_path $3/tmp/fastcgi;
    uwsgi_temp_path $3/tmp/uwsgi;
    scgi_temp_path $3/tmp/scgi;
    keepalive_timeout 300s;
    keepalive_requests 1000000;
    client_max_body_size 0;
    upstream bench {
        server 127.0.0.1:$P_UP;
        keepalive 512;
        keepalive_requests 1000000;
        keepalive_timeout 90s;
    }
    server {
        listen 127.0.0.1:$2 backlog=4096;
        location / {
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host 127.0.0.1:$P_UP;
            proxy_set_header X-API-Key "";
            proxy_set_header Authorization "Bearer $KEY";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
            proxy_send_timeout 300s;
        }
    }
}
EOF
}

haproxy_conf() { # port file
    cat >"$2" <<EOF
global
    maxconn 4096
    log stdout format raw local0 info
defaults
    mode http
    log global
    option httplog
    option http-keep-alive
    http-reuse always
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout http-keep-alive 300s
frontend fe
    bind 127.0.0.1:$1
    default_backend be
backend be
    http-request del-header X-API-Key
    http-request set-header Authorization "Bearer $KEY"
    http-request set-header Host 127.0.0.1:$P_UP
    server up 127.0.0.1:$P_UP
EOF
}

# ---------------------------------------------------------------- processes
wait_http() { # port path
    local i
    for i in $(seq 100); do
        if curl -s -o /dev/null --max-time 1 -H 'X-API-Key: dummy' "http://127.0.0.1:$1$2"; then return 0; fi
        sleep 0.1
    done
    return 1
}

log "starting upstream, nginx x2, haproxy, abx-proxy"
"$UPSTREAM_BIN" "127.0.0.1:$P_UP" >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
PID_UP=$!
wait_http "$P_UP" /bench || die "upstream did not start: $(cat "$WORK/upstream.log")"

mkdir -p "$WORK/ngx1" "$WORK/ngx2"
nginx_conf 1 "$P_NGX1" "$WORK/ngx1"
nginx_conf 2 "$P_NGX2" "$WORK/ngx2"
nginx -p "$WORK/ngx1" -c "$WORK/ngx1/nginx.conf" 2>"$WORK/ngx1/stderr" &
PIDS+=($!)
PID_NGX1=$!
nginx -p "$WORK/ngx2" -c "$WORK/ngx2/nginx.conf" 2>"$WORK/ngx2/stderr" &
PIDS+=($!)
PID_NGX2=$!

haproxy_conf "$P_HAP" "$WORK/haproxy.cfg"
haproxy -db -f "$WORK/haproxy.cfg" >/dev/null 2>"$WORK/haproxy.stderr" &
PIDS+=($!)
PID_HAP=$!

# A clean settings chain: no ABX_* from the caller, no ./.env, no ~/.abx; a home per build.
start_abx() { # binary port admin-port stderr-file; sets ABX_STARTED
    mkdir -p "$WORK/home-$2"
    (
        cd "$WORK"
        for v in $(compgen -e | grep '^ABX_' || true); do unset "$v"; done
        export ABX_HOME="$WORK/home-$2" ABX_SANDBOX_API_KEY="$KEY"
        # shellcheck disable=SC2086
        exec "$1" serve --listen "127.0.0.1:$2" --admin-listen "127.0.0.1:$3" \
            --sandbox-base-url "http://127.0.0.1:$P_UP" ${ABX_EXTRA_ARGS:-} 2>"$4"
    ) &
    ABX_STARTED=$!
    PIDS+=($!)
}
# Access log to /dev/null like the others; on a failed start, start again to see why.
launch_abx() { # name binary port admin-port; sets ABX_STARTED
    start_abx "$2" "$3" "$4" /dev/null
    if ! wait_http "$3" /bench; then
        kill "$ABX_STARTED" 2>/dev/null || true
        start_abx "$2" "$3" "$4" "$WORK/$1.stderr"
        wait_http "$3" /bench || die "$1 did not start: $(cat "$WORK/$1.stderr")"
    fi
}
launch_abx abx-proxy "$ABX" "$P_ABX" "$P_ADMIN"
PID_ABX=$ABX_STARTED
ABX_TARGETS=(abx-proxy)
if [[ -n ${PGO:-} ]]; then
    launch_abx abx-pgo "$ABX_PGO" "$P_PGO" "$P_PGO_ADMIN"
    PID_PGO=$ABX_STARTED
    ABX_TARGETS+=(abx-pgo)
fi
wait_http "$P_NGX1" /bench || die "nginx (1 worker) did not start: $(cat "$WORK/ngx1/stderr" "$WORK/ngx1/error.log" 2>/dev/null)"
wait_http "$P_NGX2" /bench || die "nginx (2 workers) did not start: $(cat "$WORK/ngx2/stderr" "$WORK/ngx2/error.log" 2>/dev/null)"
wait_http "$P_HAP" /bench || die "haproxy did not start: $(cat "$WORK/haproxy.stderr")"

TARGETS=(direct nginx-1w nginx-2w haproxy "${ABX_TARGETS[@]}")
port_of() {
    case $1 in
    direct) echo "$P_UP" ;; nginx-1w) echo "$P_NGX1" ;; nginx-2w) echo "$P_NGX2" ;;
    haproxy) echo "$P_HAP" ;; abx-proxy) echo "$P_ABX" ;; abx-pgo) echo "$P_PGO" ;;
    esac
}
# The processes whose memory counts: the proxy (nginx: master and workers).
pids_of() {
    local m
    case $1 in
    direct) echo "$PID_UP" ;;
    nginx-1w | nginx-2w)
        m=$PID_NGX1
        [[ $1 == nginx-2w ]] && m=$PID_NGX2
        echo "$m $(pgrep -P "$m" | tr '\n' ' ')"
        ;;
    haproxy) echo "$PID_HAP" ;; abx-proxy) echo "$PID_ABX" ;; abx-pgo) echo "$PID_PGO" ;;
    esac
}

# Same rewrite everywhere: the key attached, the dummy gone, the upstream's Host.
for t in "${TARGETS[@]:1}"; do
    h=$(curl -s --max-time 5 -H 'X-API-Key: dummy' -H 'Authorization: Bearer dummy' \
        "http://127.0.0.1:$(port_of "$t")/headers" | tr 'A-Z' 'a-z')
    grep -qx "authorization: bearer ${KEY,,}" <<<"$h" || die "$t: no injected Authorization: $h"
    grep -q '^x-api-key:' <<<"$h" && die "$t: X-API-Key reached the upstream"
    grep -qx "host: 127.0.0.1:$P_UP" <<<"$h" || die "$t: Host not rewritten: $h"
done

# ---------------------------------------------------------------- memory
status_kb() { # pid field -> kB
    local k v _
    while read -r k v _; do
        if [[ $k == "$2:" ]]; then
            echo "$v"
            return
        fi
    done <"/proc/$1/status" 2>/dev/null
    echo 0
}
sum_kb() { # field pids...
    local f=$1 total=0 p
    shift
    for p in "$@"; do total=$((total + $(status_kb "$p" "$f"))); done
    echo "$total"
}
export -f status_kb sum_kb # for the RSS poller (`with_peak_rss`)
CLEAR_REFS=0
if echo 5 >"/proc/$PID_ABX/clear_refs" 2>/dev/null; then CLEAR_REFS=1; fi

# Runs "$@" while tracking the peak RSS (kB) of the target's processes; prints it to fd 3.
with_peak_rss() { # target cmd...
    local t=$1 p poller peak_file="$WORK/peak"
    shift
    local pids
    read -r -a pids <<<"$(pids_of "$t")"
    echo 0 >"$peak_file"
    if ((CLEAR_REFS)); then
        for p in "${pids[@]}"; do echo 5 >"/proc/$p/clear_refs" 2>/dev/null || true; done
    else
        # Its own process, which ends with the script, and holds none of the caller's
        # `$(…)` pipe: a subshell inherited it (as fd 3, and as the copy of stdout bash
        # keeps while the call's redirections last; an exec'd one gets neither), and a
        # background job ignores Ctrl-C, so the script waited on the pipe forever, its trap
        # and cleanup not run, and the poller outlived it.
        bash -c 'script=$1 peak_file=$2 max=0
            shift 2
            while kill -0 "$script" 2>/dev/null; do
                cur=$(sum_kb VmRSS "$@")
                ((cur > max)) && max=$cur && echo "$max" >"$peak_file"
                sleep 0.1
            done' rss-poller "$$" "$peak_file" "${pids[@]}" 3>&- </dev/null >/dev/null 2>&1 &
        poller=$!
    fi
    "$@"
    if ((CLEAR_REFS)); then
        sum_kb VmHWM "${pids[@]}" >"$peak_file"
    else
        kill "$poller" 2>/dev/null || true
        wait "$poller" 2>/dev/null || true
    fi
    cat "$peak_file" >&3
}

# "target:idle_kB" for each abx-proxy build, as started (one request per target check).
IDLE_RSS=""
for t in "${ABX_TARGETS[@]}"; do IDLE_RSS+="$t:$(status_kb "$(pids_of "$t")" VmRSS) "; done

# ---------------------------------------------------------------- 1. request rate
to_ms() { # wrk latency ("612.00us", "1.23ms", "2.00s") -> ms
    awk -v v="$1" 'BEGIN {
        n = v + 0; u = v; sub(/^[0-9.]+/, "", u)
        if (u == "us") n /= 1000; else if (u == "s") n *= 1000; else if (u == "m") n *= 60000
        printf "%.3f", n }'
}
RESULTS="$WORK/results.tsv"
: >"$RESULTS"
CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() { # pids... -> user + system clock ticks, all threads, so far
    local total=0 p
    for p in "$@"; do
        # The process's own line; the command name (field 2) has no spaces for ours.
        total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
    done
    echo "$total"
}
run_wrk() { # target conns round
    local port out rss pids cpu0 cpu1
    port=$(port_of "$1")
    out="$WORK/wrk.out"
    read -r -a pids <<<"$(pids_of "$1")"
    cpu0=$(cpu_ticks "${pids[@]}")
    # `--foreground`: in a process group of its own, wrk would not get a Ctrl-C, and the
    # script would wait for the round's end.
    rss=$(with_peak_rss "$1" timeout --foreground $((DUR + 20)) wrk -t2 -c"$2" -d"${DUR}s" --timeout 5s --latency \
        -H 'X-API-Key: dummy' "http://127.0.0.1:$port/bench" 3>&1 >"$out" 2>&1) || true
    cpu1=$(cpu_ticks "${pids[@]}")
    local rps p50 p99 errs n cpu
    rps=$(awk '/^Requests\/sec:/ {print $2}' "$out")
    n=$(awk '/requests in/ {print $1}' "$out")
    # The target's CPU time (user + system) per request: what it costs the machine, and
    # steadier between runs than the rate on a machine the load generator shares.
    cpu=$(awk -v t=$((cpu1 - cpu0)) -v hz="$CLK_TCK" -v n="${n:-0}" 'BEGIN { if (n > 0) printf "%.1f", t * 1e6 / hz / n; else print 0 }')
    p50=$(to_ms "$(awk '$1 == "50%" {print $2}' "$out")")
    p99=$(to_ms "$(awk '$1 == "99%" {print $2}' "$out")")
    errs=$(awk '/Non-2xx/ {e += $NF} /Socket errors/ {gsub(",", ""); e += $4 + $6 + $8 + $10} END {print e + 0}' "$out")
    [[ -n $rps ]] || { rps=0; log "wrk against $1 failed: $(head -c 300 "$out")"; }
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$rps" "$p50" "$p99" "$rss" "$errs" "$cpu" >>"$RESULTS"
    log "$(printf '%-10s c=%-4s round %s: %10s req/s  p50 %7s ms  p99 %8s ms  peak %6s kB  cpu %5s us/req  errors %s' \
        "$1" "$2" "$3" "$rps" "$p50" "$p99" "$rss" "$cpu" "$errs")"
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
log "warm-up"
for t in "${TARGETS[@]}"; do
    timeout 20 wrk -t2 -c64 -d1s -H 'X-API-Key: dummy' "http://127.0.0.1:$(port_of "$t")/bench" >/dev/null 2>&1 || true
done
part rate || ROUNDS=0
for round in $(seq "$ROUNDS"); do
    # Rotate the order every round so no target always runs right after the same one.
    order=("${TARGETS[@]:$(((round - 1) % ${#TARGETS[@]}))}" "${TARGETS[@]:0:$(((round - 1) % ${#TARGETS[@]}))}")
    for c in $CONNS; do
        for t in "${order[@]}"; do run_wrk "$t" "$c" "$round"; done
    done
done

# ---------------------------------------------------------------- 2. transfers
XFER="$WORK/xfer.tsv"
: >"$XFER"
transfer() { # target direction
    local port out rss
    port=$(port_of "$1")
    out="$WORK/curl.out"
    if [[ $2 == down ]]; then
        rss=$(with_peak_rss "$1" curl -s -o /dev/null --max-time 180 -w '%{size_download} %{time_total}' \
            "http://127.0.0.1:$port/download?bytes=$XFER_BYTES" 3>&1 >"$out" 2>&1) || true
    else
        # A sized upload (Content-Length, no chunking, no Expect round trip), from a pipe.
        rss=$(with_peak_rss "$1" bash -c "head -c $XFER_BYTES /dev/zero | curl -s -o '$WORK/up.body' \
            --max-time 180 -X POST -T - -H 'Content-Length: $XFER_BYTES' -H 'Transfer-Encoding:' \
            -H 'Expect:' -w '%{size_upload} %{time_total}' 'http://127.0.0.1:$port/upload'" 3>&1 >"$out" 2>&1) || true
        grep -q "\"received\":$XFER_BYTES" "$WORK/up.body" 2>/dev/null || { log "$1 upload incomplete: $(cat "$WORK/up.body" 2>/dev/null)"; echo "0 1" >"$out"; }
    fi
    local size secs
    read -r size secs <"$out" || true
    [[ ${size:-0} == "$XFER_BYTES" ]] || { log "$1 $2: transferred ${size:-0} of $XFER_BYTES"; secs=0; }
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(awk -v b="$XFER_BYTES" -v s="${secs:-0}" 'BEGIN { if (s > 0) printf "%.0f", b / s / 1048576; else print 0 }')" "$rss" >>"$XFER"
    log "$(printf '%-10s %-4s %6s MiB/s  peak %7s kB' "$1" "$2" "$(tail -1 "$XFER" | cut -f3)" "$rss")"
}
if part xfer; then
    for round in $(seq "$XFER_ROUNDS"); do
        order=("${TARGETS[@]:$(((round - 1) % ${#TARGETS[@]}))}" "${TARGETS[@]:0:$(((round - 1) % ${#TARGETS[@]}))}")
        for t in "${order[@]}"; do
            transfer "$t" down
            transfer "$t" up
        done
    done
fi

# ---------------------------------------------------------------- 3. idle connections
cat >"$WORK/idle.py" <<'EOF'
import socket, sys, time
port, n, ready, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
req = b"GET /bench HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-API-Key: dummy\r\n\r\n" % port
socks, deadline = [], time.monotonic() + 60
def one():
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(req)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096) or b"!\r\n\r\n"
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += s.recv(4096) or b"!" * length
    return s
for i in range(n):
    if time.monotonic() > deadline:
        break
    # A connection left unanswered (the target serves no more at once): keep what is held.
    try:
        socks.append(one())
    except OSError as e:
        print(f"idle: connection {i + 1} not served ({e}); holding {len(socks)}", file=sys.stderr)
        break
# A target short of slots closes idle connections to make room for a waiting one (nginx's
# "reusing connections", abx-proxy's too): only those still open are held.
closed = 0
for s in socks:
    s.settimeout(0)
    try:
        closed += s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        pass
    except OSError:
        closed += 1
if closed:
    print(f"idle: {closed} of {len(socks)} served were closed by the target to make room", file=sys.stderr)
open(ready, "w").write(str(len(socks) - closed))
time.sleep(hold)
EOF
idle_test() { # target -> "conns rss_before_kB rss_after_kB"
    local port ready="$WORK/idle.ready" py before after held i pids
    port=$(port_of "$1")
    read -r -a pids <<<"$(pids_of "$1")"
    rm -f "$ready"
    before=$(sum_kb VmRSS "${pids[@]}")
    # Not on the caller's `$(…)` pipe: a background job ignores Ctrl-C, and the pipe held
    # open would keep the script waiting for it (up to its timeout), its trap not run.
    timeout 120 python3 "$WORK/idle.py" "$port" "$IDLE_CONNS" "$ready" 30 >/dev/null &
    py=$!
    # For `cleanup`: a background job ignores Ctrl-C, and this runs in a `$(…)` subshell.
    echo "$py" >"$WORK/idle.pid"
    for i in $(seq 900); do [[ -s $ready ]] && break; kill -0 "$py" 2>/dev/null || break; sleep 0.1; done
    held=$(cat "$ready" 2>/dev/null || echo 0)
    sleep 1 # let the proxy settle (pool and buffers)
    after=$(sum_kb VmRSS "${pids[@]}")
    kill "$py" 2>/dev/null || true
    wait "$py" 2>/dev/null || true
    # Gone: a later `cleanup` would kill whatever process had its id by then.
    rm -f "$WORK/idle.pid"
    echo "$held $before $after"
}
# "target:conns:before_kB:after_kB" for each target held idle.
IDLE_HELD=""
if part idle; then
    for t in "${ABX_TARGETS[@]}" nginx-1w; do
        read -r n before after <<<"$(idle_test "$t")"
        IDLE_HELD+="$t:$n:$before:$after "
        sleep 2
    done
fi
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# ---------------------------------------------------------------- report
python3 - "$RESULTS" "$XFER" "$ROUNDS" "$DUR" <<EOF
import statistics, sys
from collections import defaultdict
results, xfer, rounds, dur = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
runs = defaultdict(list)
by_round = defaultdict(dict)
for line in open(results):
    t, c, r, rps, p50, p99, rss, errs, cpu = line.split("\t")
    runs[(t, int(c))].append((float(rps), float(p50), float(p99), int(rss), int(errs), float(cpu)))
    by_round[(t, int(c))][r] = float(rps)
med = lambda xs: statistics.median(xs)
order = ["direct", "nginx-1w", "nginx-2w", "haproxy", "abx-proxy", "abx-pgo"]
conns = sorted({c for _, c in runs})
print()
print("## Request rate (GET, 53-byte body; wrk -t2, ${DUR}s x ${ROUNDS} rounds, interleaved; medians)")
print()
print(f"machine: $(nproc) cores; load average at start {'$LOAD_START'}, at end {'$LOAD_END'}")
print()
print("| target | conns | req/s | p50 ms | p99 ms | peak RSS MiB | CPU us/req | req/s vs best nginx | p99 vs best nginx | req/s vs haproxy | errors |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
summary = {}
best_nginx = {}
for c in conns:
    best = max((t for t in ("nginx-1w", "nginx-2w") if (t, c) in runs), key=lambda t: med([x[0] for x in runs[(t, c)]]), default=None)
    best_nginx[c] = best
    brps = med([x[0] for x in runs[(best, c)]]) if best else 0
    bp99 = med([x[2] for x in runs[(best, c)]]) if best else 0
    hrps = med([x[0] for x in runs[("haproxy", c)]]) if ("haproxy", c) in runs else 0
    for t in order:
        if (t, c) not in runs:
            continue
        xs = runs[(t, c)]
        rps, p50, p99 = med([x[0] for x in xs]), med([x[1] for x in xs]), med([x[2] for x in xs])
        rss, errs, cpu = med([x[3] for x in xs]) / 1024, sum(x[4] for x in xs), med([x[5] for x in xs])
        summary[(t, c)] = (rps / brps if brps else 0, p99 / bp99 if bp99 else 0, rps / hrps if hrps else 0, rss)
        ratio = f"{rps / brps:.2f}x" if brps else "-"
        pratio = f"{p99 / bp99:.2f}x" if bp99 else "-"
        hratio = f"{rps / hrps:.2f}x" if hrps else "-"
        print(f"| {t} | {c} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {rss:.1f} | {cpu:.1f} | {ratio} | {pratio} | {hratio} | {errs} |")
print()
print("(direct = wrk straight to the upstream, for scale; its RSS and CPU are the upstream's. best nginx = the faster of 1 and 2 workers at that connection count. CPU us/req = the target's user + system time over the run divided by the requests served.)")
print()
print("## Transfers ($((XFER_BYTES / 1048576)) MiB, curl; medians of ${XFER_ROUNDS} interleaved rounds, peak RSS the highest)")
print()
xs = defaultdict(list)  # in round order: the n-th of each target is its n-th round
for line in open(xfer):
    t, d, mibs, rss = line.split("\t")
    xs[(t, d)].append((float(mibs), int(rss)))
x = {k: (med([m for m, _ in v]), max(r for _, r in v)) for k, v in xs.items()}
print("| target | download MiB/s | vs direct | peak RSS MiB | upload MiB/s | vs direct | peak RSS MiB |")
print("|---|---:|---:|---:|---:|---:|---:|")
dd, du = x.get(("direct", "down"), (0, 0))[0], x.get(("direct", "up"), (0, 0))[0]
for t in order:
    if (t, "down") not in x:
        continue
    (dm, dr), (um, ur) = x[(t, "down")], x[(t, "up")]
    rd = f"{dm / dd:.2f}x" if dd else "-"
    ru = f"{um / du:.2f}x" if du else "-"
    print(f"| {t} | {dm:,.0f} | {rd} | {dr / 1024:.1f} | {um:,.0f} | {ru} | {ur / 1024:.1f} |")
print()
print("(direct: RSS is the upstream's.)")
print()
print("## Idle")
print()
def idle(name, n, before, after):
    per = (after - before) / n if n else 0
    print(f"- {name}: {n} idle keep-alive connections held: RSS {after / 1024:.1f} MiB (before {before / 1024:.1f} MiB, {per:.2f} KiB per connection)")
idle_rss = {t: int(kb) for t, kb in (e.split(":") for e in "$IDLE_RSS".split())}
held = {t: tuple(int(v) for v in rest) for t, *rest in (e.split(":") for e in "$IDLE_HELD".split())}
for t, kb in idle_rss.items():
    print(f"- {t} idle RSS (after start-up and one request per target check): {kb / 1024:.1f} MiB")
for t, (n, before, after) in held.items():
    idle(t + (" (reference)" if t.startswith("nginx") else ""), n, before, after)
abx = list(idle_rss)
def check(what, ok, detail):
    print(f"- {'MET    ' if ok else 'NOT MET'} {what}: {detail}")
for a in abx:
    print()
    print(f"## {a} against the targets")
    print()
    for c in (64, 256):
        if (a, c) in summary:
            vn, vp, vh, rss = summary[(a, c)]
            check(f"req/s at {c} >= 1.0x best nginx and >= 1.0x haproxy", vn >= 1 and vh >= 1, f"{vn:.2f}x nginx, {vh:.2f}x haproxy")
            check(f"p99 at {c} <= best nginx p99", 0 < vp <= 1, f"{vp:.2f}x")
    if (a, 256) in summary:
        rss = summary[(a, 256)][3]
        check("peak RSS at 256 connections <= 16 MiB", rss <= 16, f"{rss:.1f} MiB")
    idle_mib = idle_rss[a] / 1024
    check("idle RSS <= 8 MiB", idle_mib <= 8, f"{idle_mib:.1f} MiB")
    if (a, "down") in x and dd and du:
        (dm, dr), (um, ur) = x[(a, "down")], x[(a, "up")]
        check("1 GiB transfers: peak RSS <= 32 MiB", max(dr, ur) / 1024 <= 32, f"down {dr / 1024:.1f} MiB, up {ur / 1024:.1f} MiB")
        check("1 GiB transfers: throughput >= 0.8x direct", dm / dd >= 0.8 and um / du >= 0.8, f"down {dm / dd:.2f}x, up {um / du:.2f}x")
    if a in held:
        n_idle, _, after = held[a]
        check("10000 idle keep-alive connections held, RSS <= 64 MiB", n_idle >= 10000 and after / 1024 <= 64, f"{n_idle} held, {after / 1024:.1f} MiB")
print()
print("## Paired rounds (for reading the medians above; not a target)")
print()
print("The machine's speed can drift between rounds; targets that ran back to back in the same")
print("round saw the same machine. Median of the per-round ratio, and the rounds it was ahead in:")
print()
def paired(what, ours, theirs, count_ahead=True):
    ratios = [a / b for a, b in zip(ours, theirs) if a > 0 and b > 0]
    if ratios:
        ahead = sum(r >= 1 for r in ratios)
        tail = f", ahead in {ahead} of {len(ratios)} rounds" if count_ahead else f" ({len(ratios)} rounds)"
        print(f"- {what}: {med(ratios):.2f}x{tail}")
refs = lambda a, c: [r for r in (best_nginx.get(c), "haproxy") + (("abx-proxy",) if a != "abx-proxy" else ()) if r]
for a in abx:
    for c in conns:
        ours = by_round.get((a, c), {})
        for ref in refs(a, c):
            theirs = by_round.get((ref, c), {})
            common = sorted(set(ours) & set(theirs), key=int)
            paired(f"{a} req/s at {c} vs {ref}", [ours[r] for r in common], [theirs[r] for r in common])
    for d in ("down", "up"):
        paired(f"{a} $((XFER_BYTES / 1048576)) MiB {d}load vs direct", [m for m, _ in xs.get((a, d), [])], [m for m, _ in xs.get(("direct", d), [])], False)
EOF
