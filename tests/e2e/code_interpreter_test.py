#!/usr/bin/env python3
"""End-to-end driver: the real `e2b-code-interpreter` Python SDK against abx-proxy.

Run with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set (the test sets them to the
proxy). The sandbox restricts public traffic, so every request to the code interpreter's
port (49999) carries `E2B-Traffic-Access-Token` as well as the SDK's own `X-Access-Token`
on `/execute`. Prints one line per step; exits 1 with a message naming the failed step.
"""


from e2b_driver import expect, killing_on_failure, ok, require_env, run, step


def main():
    require_env("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL")

    from importlib.metadata import version

    from e2b_code_interpreter import Sandbox

    print(
        f"e2b-code-interpreter python SDK {version('e2b-code-interpreter')}"
        f" (e2b {version('e2b')})",
        flush=True,
    )

    step("create (no public traffic)")
    sbx = Sandbox.create(timeout=60, network={"allow_public_traffic": False})
    expect(sbx.sandbox_id, "no sandbox id")
    expect(sbx.traffic_access_token, "no traffic access token in the create answer")
    ok(sbx.sandbox_id)

    killing_on_failure(sbx, run_steps, sbx)


def run_steps(sbx):
    # The fake holds the rest of the run at `wait_until_seen()` until a context is made:
    # made here on seeing the first line, which therefore came while the run went on.
    step("run_code (stdout streamed, create_code_context on seeing it, a result)")
    seen, made = [], []

    def on_stdout(m):
        seen.append(m.line)
        if not made:
            made.append(sbx.create_code_context())

    ex = sbx.run_code("print('hello')\nwait_until_seen()\n40 + 2", on_stdout=on_stdout)
    expect(ex.error is None, f"error {ex.error!r}")
    expect(ex.logs.stdout == ["hello\n"], f"stdout {ex.logs.stdout!r}")
    expect(seen == ["hello\n"], f"on_stdout saw {seen!r}")
    expect(ex.text == "42", f"result {ex.text!r}, expected '42'")
    expect(len(made) == 1 and made[0].id, f"contexts made {made!r}")
    ctx = made[0]
    ok(f"stdout {ex.logs.stdout!r}, result {ex.text!r}, context {ctx.id}")

    step("run_code in the context")
    ex = sbx.run_code("1 + 2", context=ctx)
    expect(ex.text == "3", f"result {ex.text!r}, expected '3'")
    ok(repr(ex.text))

    step("list_code_contexts")
    ids = [c.id for c in sbx.list_code_contexts()]
    expect(ctx.id in ids, f"contexts {ids!r} without {ctx.id}")
    ok(repr(ids))

    step("run_code raising (the error comes back in the stream)")
    ex = sbx.run_code("undefined_name")
    expect(ex.error is not None, "no error")
    expect(ex.error.name == "NameError", f"error {ex.error.name!r}")
    ok(f"{ex.error.name}: {ex.error.value}")

    step("remove_code_context")
    sbx.remove_code_context(ctx)
    ok(ctx.id)

    step("kill")
    sbx.kill()
    ok("killed")


if __name__ == "__main__":
    run(main, "PASS python code interpreter")
