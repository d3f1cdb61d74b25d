#!/usr/bin/env bash
# The whole test suite — what CI runs (.ci/run) and what a newcomer runs on a fresh machine.
# It installs what the tests need (Debian tools, the E2B SDKs), checks formatting and lints,
# builds once and runs every test. Everything it starts listens on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
# The SDKs the end-to-end tests drive, before the build: a missing npm or a failing registry
# shows in the first minute, not after the build (the tests then find them installed).
echo "== end-to-end test SDKs (scripts/e2e-deps.sh)"
ABX_E2E_DIR="$(scripts/target-dir.sh)/e2e" scripts/e2e-deps.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings
echo "== cargo build --examples (the end-to-end tests' fakes)"
cargo build --locked --examples
echo "== cargo test"
# Every target but the examples, which are programs the tests run, not tests: built
# above as such, once (--all-targets would build each again as a test harness).
cargo test --locked --lib --bins --tests --benches
echo "== deploy files"
scripts/check-deploy.sh
