#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain, idempotently:
# Debian's prometheus (promtool, for the /metrics format check) and the rustfmt/clippy
# components; the Python/JS E2B SDKs are installed by scripts/e2e-deps.sh when the e2e test
# first runs. Quiet when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
for comp in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$comp" || rustup component add "$comp"
done
