#!/usr/bin/env bash
# Dependency audit: every crate in Cargo.lock (and fuzz/Cargo.lock) against the RustSec
# advisory database, with cargo-audit.
#
#   scripts/audit.sh                      fetch the database from GitHub, then audit
#   ABX_ADVISORY_DB=/path scripts/audit.sh  use a local clone of rustsec/advisory-db, offline
#
# Installs cargo-audit when missing (`cargo install --locked`). Exit status: 0 no
# vulnerability (unmaintained/unsound notices are printed as warnings, not failures); 1 a
# vulnerability was found; 3 the advisory database could not be had (cargo-audit fetches it
# from github.com: a machine that reaches only the package registries needs ABX_ADVISORY_DB);
# other values: cargo-audit could not run (124 or 137: it did not finish within 10 minutes).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1

if ! cargo audit --version >/dev/null 2>&1; then
    echo "installing cargo-audit ..." >&2
    # Bounded: a registry that stops answering fails the script instead of hanging it.
    timeout -k 10 1800 cargo install --locked cargo-audit || exit 1
fi

db_args=()
if [ -n "${ABX_ADVISORY_DB:-}" ]; then
    db_args=(--db "$ABX_ADVISORY_DB" --no-fetch)
fi

status=0
fetched=0
for lock in Cargo.lock fuzz/Cargo.lock; do
    [ -f "$lock" ] || continue
    echo "== cargo audit $lock" >&2
    args=("${db_args[@]}")
    if [ "$fetched" -eq 1 ] && [ -z "${ABX_ADVISORY_DB:-}" ]; then
        args=(--no-fetch)   # fetched once already
    fi
    # Bounded: the database's fetch is a git clone that may stall.
    out="$(timeout -k 10 600 cargo audit "${args[@]}" --file "$lock" 2>&1)"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        printf '%s\n' "$out"
        echo "audit: cargo audit did not finish within 10 minutes (or was killed)" >&2
        exit "$rc"
    fi
    printf '%s\n' "$out"
    if printf '%s\n' "$out" | grep -q "couldn't fetch advisory database\|error loading advisory database\|failed to open advisory database"; then
        echo "audit: the advisory database could not be had; set ABX_ADVISORY_DB to a local clone of rustsec/advisory-db" >&2
        exit 3
    fi
    fetched=1
    if [ "$rc" -ne 0 ]; then
        status=1
    fi
done
exit "$status"
