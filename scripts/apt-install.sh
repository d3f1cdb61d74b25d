#!/usr/bin/env bash
# Installs Debian packages for the project's scripts: `scripts/apt-install.sh PKG...`.
# Through `sudo -n` unless root (a password prompt fails at once instead of waiting for an
# answer); every step bounded by `timeout` (a mirror that never answers fails the run). A
# lock another apt holds (apt-daily or unattended-upgrades at a VM's boot) is waited for,
# up to 4 minutes: `apt-get update` does not wait for its lists lock by itself, so it is
# tried again while that is the error; `install` waits through DPkg::Lock::Timeout.
set -euo pipefail

SUDO=()
[ "$(id -u)" -eq 0 ] || SUDO=(sudo -n)

for attempt in $(seq 24); do
    # LC_ALL=C: the lock's message is matched below, in apt's own words.
    if out=$(timeout -k 10 300 "${SUDO[@]}" env LC_ALL=C apt-get -o DPkg::Lock::Timeout=240 update -qq 2>&1); then
        break
    fi
    if ! grep -q "Could not get lock" <<<"$out" || [ "$attempt" -eq 24 ]; then
        printf '%s\n' "$out" >&2
        exit 1
    fi
    sleep 10
done
timeout -k 10 600 "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get -o DPkg::Lock::Timeout=240 install -y -qq --no-install-recommends "$@" >/dev/null
