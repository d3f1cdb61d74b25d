"""What the E2B SDK drivers share: named steps printed one line each, and one way to fail.

A driver calls `require_env(...)`, then `step(name)` before each step and `ok(msg)` after
it, and hands its `main` to `run`, which prints `FAIL <step>: …` (the line the Rust tests
show) and exits 1 on any exception, or prints its PASS line.
"""

import os
import sys
import traceback

_step = "import"


def step(name):
    global _step
    _step = name


def ok(msg):
    print(f"ok   {_step}: {msg}", flush=True)


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def require_env(*names):
    for name in names:
        if not os.environ.get(name):
            raise AssertionError(f"{name} must be set")


def killing_on_failure(sbx, steps, *args):
    """Runs `steps(*args)`; a step that fails does not leave the sandbox behind."""
    try:
        steps(*args)
    except BaseException:
        try:
            sbx.kill()
        except Exception:
            pass
        raise


def run(main, passed):
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - report every failure the same way
        traceback.print_exc()
        print(f"FAIL {_step}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(passed, flush=True)
