#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain, idempotently:
# Debian's prometheus (promtool, for the /metrics format check), systemd (systemd-analyze,
# for the unit in deploy/), procps (kill), python3-venv (the venvs of scripts/e2e-deps.sh and
# scripts/check-deploy.sh) and the rustfmt/clippy components (through
# scripts/apt-install.sh); the Python/JS E2B SDKs are installed by scripts/e2e-deps.sh,
# which scripts/test.sh runs next, with the machine's npm (Node.js 20.18.1 or newer, newer
# than Debian 12 has). Quiet when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# `python3 -m venv` needs ensurepip, which Debian ships apart from python3.
python3 -c 'import ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
# The tests signal the proxy with kill(1), which slim images leave out (`command -v kill`
# finds the shell's builtin).
[ -x /bin/kill ] || [ -x /usr/bin/kill ] || need_apt+=(procps)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need_apt[*]}"
  scripts/apt-install.sh "${need_apt[@]}"
  SUDO=()
  [ "$(id -u)" -eq 0 ] || SUDO=(sudo -n)
  # The package is here for promtool; it also starts a Prometheus server listening on
  # every interface (through systemd, or its init script where there is none: sysvinit,
  # LXC, WSL), and enables it at boot, which the tests do not want.
  if [[ " ${need_apt[*]} " == *" prometheus "* ]]; then
    if [ -d /run/systemd/system ]; then
      timeout -k 10 60 "${SUDO[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
    else
      timeout -k 10 60 "${SUDO[@]}" invoke-rc.d prometheus stop >/dev/null 2>&1 || true
      timeout -k 10 60 "${SUDO[@]}" update-rc.d prometheus disable >/dev/null 2>&1 || true
    fi
    echo "== prometheus was installed for promtool only: its service is stopped and disabled"
  fi
fi
for comp in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$comp" ||
    timeout -k 10 600 rustup component add "$comp" ||
    { echo "deps: rustup component add $comp failed or did not finish in 10 minutes" >&2; exit 1; }
done
