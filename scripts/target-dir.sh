#!/usr/bin/env bash
# Prints the absolute path of cargo's target directory for this repository, as cargo itself
# resolves it (CARGO_TARGET_DIR, CARGO_BUILD_TARGET_DIR, `build.target-dir` in a cargo
# config, else target/): the scripts run the binaries cargo built, and the end-to-end SDKs
# go where the tests look for them.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo metadata --no-deps --format-version 1 2>/dev/null \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null; then
    realpath -m "${CARGO_TARGET_DIR:-target}"
fi
