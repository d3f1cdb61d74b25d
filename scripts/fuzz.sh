#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time, one after the other.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      default 60
#   FUZZ_TARGETS="manifest sniff" scripts/fuzz.sh 300    only these targets
#   FUZZ_MERGE=1 scripts/fuzz.sh 600     then fold new coverage into fuzz/corpus (see below)
#
# Not part of the test suite. Installs cargo-fuzz when missing. Works on the stable
# toolchain: `-s none` (no sanitizer) is what makes that possible — the default
# AddressSanitizer build needs `-Zsanitizer`, which stable rustc refuses. The library is
# `#![forbid(unsafe_code)]`, so what the targets look for is panics (including overflow
# checks and debug assertions, which cargo-fuzz turns on) and broken invariants, plus
# timeouts and runaway memory.
#
# New inputs go to fuzz/target/corpus-work/<target> (ignored by git); the committed seeds in
# fuzz/corpus/<target> are only read. With FUZZ_MERGE=1, a target that did not crash then
# adds to fuzz/corpus/<target> the fewest inputs that reach its new edges (libFuzzer's
# `-set_cover_merge` on edges only, a smaller set than `cargo fuzz cmin`): keep the committed
# corpus small (well under 2 MB) and review what it adds.
#
# Crashes are written to fuzz/artifacts/<target>/; replay one with `cargo fuzz run -s none <target> <file>` (or run the built binary,
# <target dir>/<host>/release/<target>, on the file; fuzz/target unless set otherwise).
#
# Prints per target the executions, the duration and the crashes found; exits 1 when any
# target crashed (or failed to build), 0 otherwise.
set -uo pipefail

SECONDS_PER_TARGET="${1:-60}"
case "$SECONDS_PER_TARGET" in
    '' | *[!0-9]*) echo "usage: $0 [SECONDS_PER_TARGET]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz ..." >&2
    # Bounded: a registry that stops answering fails the script instead of hanging it.
    timeout -k 10 1800 cargo install --locked cargo-fuzz || exit 1
fi

SANITIZER=(-s none)
TARGETS="${FUZZ_TARGETS:-$(cargo fuzz list)}"

echo "building fuzz targets (first build: several minutes) ..." >&2
if ! cargo fuzz build "${SANITIZER[@]}" >&2; then
    echo "fuzz: build failed" >&2
    exit 1
fi

# Where cargo put the fuzz crate's build, as cargo resolves it (CARGO_TARGET_DIR,
# CARGO_BUILD_TARGET_DIR, build.target-dir): cargo fuzz passes no target directory of its
# own and runs cargo here, at the root, with fuzz/'s manifest; so does this, as a relative
# directory is taken from where cargo runs.
FUZZ_TARGET_DIR="$(cargo metadata --no-deps --format-version 1 --manifest-path fuzz/Cargo.toml 2>/dev/null |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null ||
    echo fuzz/target)"
BIN="$FUZZ_TARGET_DIR/$(rustc -vV | sed -n 's/^host: //p')/release"

failed=0
summary=()
for target in $TARGETS; do
    work="fuzz/target/corpus-work/$target"
    artifacts="fuzz/artifacts/$target"
    mkdir -p "$work" "$artifacts"
    log="fuzz/target/fuzz-$target.log"
    before="$(ls -1 "$artifacts" 2>/dev/null | sort)"

    echo "== $target: ${SECONDS_PER_TARGET}s" >&2
    start=$(date +%s)
    # The binary `cargo fuzz build` made, run directly: `cargo fuzz run` would rebuild (and
    # count the build in the time) whenever the sources changed since.
    "$BIN/$target" "$work" "fuzz/corpus/$target" -artifact_prefix="$artifacts/" \
        -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 >"$log" 2>&1
    rc=$?
    elapsed=$(($(date +%s) - start))

    # Executions: the final stats, else the last status line (`#1234 ...`).
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
    if [ -z "$execs" ]; then
        execs="$(grep -oE '^#[0-9]+' "$log" | tail -n 1 | tr -d '#')"
    fi
    new="$(comm -13 <(printf '%s\n' "$before") <(ls -1 "$artifacts" 2>/dev/null | sort) | sed '/^$/d')"
    crashes="$(printf '%s\n' "$new" | sed '/^$/d' | wc -l | tr -d ' ')"
    if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
        crashes="?"   # failed without writing an artifact: see the log
    fi

    if [ "${FUZZ_MERGE:-0}" = 1 ] && [ "$rc" -eq 0 ] && [ "$crashes" = "0" ]; then
        before_files=$(ls -1 "fuzz/corpus/$target" | wc -l)
        "$BIN/$target" -set_cover_merge=1 -use_counters=0 "fuzz/corpus/$target" "$work" \
            >"fuzz/target/merge-$target.log" 2>&1 || echo "   merge failed: fuzz/target/merge-$target.log"
        echo "   merged: fuzz/corpus/$target $before_files -> $(ls -1 "fuzz/corpus/$target" | wc -l) files" >&2
    fi

    line="$(printf '%-18s executions=%-10s duration=%ss crashes=%s' "$target" "${execs:-0}" "$elapsed" "$crashes")"
    summary+=("$line")
    echo "$line"
    if [ "$rc" -ne 0 ] || [ "$crashes" != "0" ]; then
        failed=1
        for f in $new; do
            echo "   $artifacts/$f"
        done
        { grep -m 1 -A 1 "panicked at" "$log" || grep -m 1 "ERROR: libFuzzer" "$log"; } | cut -c 1-300 | sed 's/^/   /'
        echo "   log: $log"
    fi
done

echo
echo "summary (${SECONDS_PER_TARGET}s per target):"
printf '  %s\n' "${summary[@]}"
exit "$failed"
