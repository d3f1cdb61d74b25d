"""End-to-end driver for the real `opensandbox` Python SDK (run by tests/e2e_opensandbox.rs).

Configured the way a user configures the SDK, from the environment only:
  OPEN_SANDBOX_DOMAIN   where the lifecycle API is (abx-proxy's 127.0.0.1:PORT); the SDK
                        adds http:// and /v1 itself
  OPEN_SANDBOX_API_KEY  a dummy key; abx-proxy replaces it with the real one

Steps: create a sandbox (the SDK then resolves the execd and egress endpoints, probes
execd's /ping until ready, and reports a `sandbox.create` metric in a background thread),
get it, kill it, and get it again (expecting 404). One line per step on stdout; exit 1
with a message on the first failure.
"""

import os
import sys
import threading
import time
import traceback
from datetime import timedelta


def fail(step, msg):
    print(f"FAIL {step}: {msg}", flush=True)
    sys.exit(1)


def main():
    for name in ("OPEN_SANDBOX_DOMAIN", "OPEN_SANDBOX_API_KEY"):
        if not os.environ.get(name):
            fail("setup", f"{name} is not set")

    try:
        from importlib.metadata import version

        from opensandbox.exceptions import SandboxApiException
        from opensandbox.sync.sandbox import SandboxSync
    except Exception as e:  # noqa: BLE001
        fail("import", f"cannot import opensandbox: {e!r}")
    print(
        f"ok import opensandbox {version('opensandbox')} "
        f"domain={os.environ['OPEN_SANDBOX_DOMAIN']}",
        flush=True,
    )

    step = "create"
    try:
        t0 = time.monotonic()
        sandbox = SandboxSync.create(
            "python:3.11",
            entrypoint=["sleep", "infinity"],
            metadata={"purpose": "abx-e2e"},
            timeout=timedelta(minutes=5),
            ready_timeout=timedelta(seconds=30),
        )
        sid = sandbox.id
        if not sid:
            fail(step, "no sandbox id")
        print(f"ok create id={sid} ({(time.monotonic() - t0) * 1000:.0f} ms)", flush=True)

        # create() reports its latency from a daemon thread (POST /v1/metrics/events);
        # wait for it so the request count is deterministic.
        step = "metrics"
        for t in threading.enumerate():
            if t is not threading.main_thread() and t.daemon:
                t.join(timeout=20)
                if t.is_alive():
                    fail(step, f"background thread {t.name} did not finish")
        print("ok metrics report sent", flush=True)

        step = "get"
        info = sandbox.get_info()
        if info.id != sid:
            fail(step, f"id {info.id!r} != {sid!r}")
        if info.status.state != "Running":
            fail(step, f"state {info.status.state!r}, expected 'Running'")
        if (info.metadata or {}).get("purpose") != "abx-e2e":
            fail(step, f"metadata did not round-trip: {info.metadata!r}")
        if info.image is None or info.image.image != "python:3.11":
            fail(step, f"image did not round-trip: {info.image!r}")
        print(f"ok get state={info.status.state} entrypoint={info.entrypoint}", flush=True)

        step = "kill"
        sandbox.kill()
        print("ok kill", flush=True)

        step = "get after kill"
        try:
            sandbox.get_info()
        except SandboxApiException as e:
            if e.status_code != 404:
                fail(step, f"HTTP {e.status_code}, expected 404: {e}")
            print("ok get after kill: 404", flush=True)
        else:
            fail(step, "the sandbox still exists")
        sandbox.close()
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        fail(step, f"{type(e).__name__}: {e}")

    print("PASS", flush=True)


if __name__ == "__main__":
    main()
