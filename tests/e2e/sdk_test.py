#!/usr/bin/env python3
"""End-to-end driver: the real `e2b` Python SDK (sync API) against abx-proxy or the fake.

Run with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set (the test sets them to the
proxy). Prints one line per step; exits 1 with a message naming the failed step.

Works with e2b 2.20 (whose connected sandbox names itself by its token alone), 2.50
(POST /sandboxes) and 2.51+ (POST /v2/sandboxes).
"""

import inspect
import os

from e2b_driver import expect, killing_on_failure, ok, require_env, run, step


def main():
    require_env("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL")

    from importlib.metadata import version

    from e2b import Sandbox

    print(f"e2b python SDK {version('e2b')}", flush=True)

    step("create")
    sbx = Sandbox.create(template="base", timeout=60, metadata={"k": "v"})
    sid = sbx.sandbox_id
    expect(sid, "no sandbox id")
    ok(sid)

    killing_on_failure(sbx, run_steps, Sandbox, sbx, sid)


def run_steps(Sandbox, sbx, sid):
    step("commands.run echo hi")
    r = sbx.commands.run("echo hi")
    expect(r.stdout == "hi\n", f"stdout is {r.stdout!r}, expected 'hi\\n'")
    expect(r.exit_code == 0, f"exit code {r.exit_code}")
    ok(repr(r.stdout))

    step("commands.run whoami as root (client Basic auth kept)")
    r = sbx.commands.run("whoami", user="root")
    expect(r.stdout == "root\n", f"stdout is {r.stdout!r}, expected 'root\\n'")
    ok(repr(r.stdout))

    step("commands.run whoami (default user)")
    r = sbx.commands.run("whoami")
    expect(r.stdout == "user\n", f"stdout is {r.stdout!r}, expected 'user\\n'")
    ok(repr(r.stdout))

    path = "/home/user/hello.txt"
    step("files.write (multipart)")
    info = sbx.files.write(path, "hello world")
    expect(info.path == path, f"write returned path {info.path!r}")
    ok(info.path)

    step("files.read (text)")
    text = sbx.files.read(path)
    expect(text == "hello world", f"read {text!r}, expected 'hello world'")
    ok(repr(text))

    bin_path = "/tmp/bin.dat"
    payload = b"\x00\x01binary\xff" * 1000
    # Before 2.50 every upload is multipart: the octet-stream form came later.
    if "use_octet_stream" in inspect.signature(sbx.files.write).parameters:
        step("files.write (octet-stream)")
        info = sbx.files.write(bin_path, payload, use_octet_stream=True)
    else:
        step("files.write (bytes, multipart)")
        info = sbx.files.write(bin_path, payload)
    expect(info.path == bin_path, f"write returned path {info.path!r}")
    ok(f"{len(payload)} bytes")

    step("files.read (bytes, user root)")
    data = sbx.files.read(bin_path, format="bytes", user="root")
    expect(bytes(data) == payload, f"read {len(data)} bytes that differ from the upload")
    ok(f"{len(data)} bytes")

    step("files.list (Connect unary ListDir)")
    names = [e.name for e in sbx.files.list("/home/user")]
    expect(names == ["hello.txt"], f"list gave {names!r}")
    ok(repr(names))

    step("is_running")
    expect(sbx.is_running() is True, "is_running() is not True")
    ok("True")

    step("set_timeout")
    sbx.set_timeout(120)
    ok("120 s")

    step("get_info")
    info = sbx.get_info()
    expect(info.sandbox_id == sid, f"get_info sandbox_id {info.sandbox_id!r} != {sid!r}")
    expect(info.template_id == "base", f"template_id {info.template_id!r}")
    expect(info.metadata == {"k": "v"}, f"metadata {info.metadata!r}")
    ok(f"{info.sandbox_id} template={info.template_id} metadata={info.metadata}")

    # e2b 2.64 takes an `Authorization` header (an OAuth token) in place of a key: a client
    # with no key sends only that, which the proxy replaces with the real key as it does a
    # dummy one (the fake refuses the token, the dummy key here, anywhere upstream).
    step("get_info with an Authorization header and no key")
    if sdk_version() >= (2, 64):
        key = os.environ.pop("E2B_API_KEY")
        try:
            info = Sandbox.get_info(sid, api_headers={"Authorization": f"Bearer {key}"})
        finally:
            os.environ["E2B_API_KEY"] = key
        expect(info.sandbox_id == sid, f"get_info sandbox_id {info.sandbox_id!r} != {sid!r}")
        ok(info.sandbox_id)
    else:
        ok("skipped: this SDK needs a key")

    step("Sandbox.connect")
    again = Sandbox.connect(sid)
    expect(again.sandbox_id == sid, f"connect gave {again.sandbox_id!r}")
    ok(again.sandbox_id)

    step("commands.run on the connected sandbox")
    r = again.commands.run("echo connected")
    expect(r.stdout == "connected\n", f"stdout is {r.stdout!r}")
    ok(repr(r.stdout))

    step("kill")
    killed = sbx.kill()
    expect(killed in (True, None), f"kill() returned {killed!r}")
    ok("killed")

    step("is_running after kill")
    expect(sbx.is_running() is False, "is_running() is not False after kill")
    ok("False")

    step("is_running after kill (the connected sandbox)")
    expect(again.is_running() is False, "is_running() is not False after kill")
    ok("False")


def sdk_version():
    from importlib.metadata import version

    return tuple(int(p) for p in version("e2b").split(".")[:2])


if __name__ == "__main__":
    run(main, "PASS python")
