#!/usr/bin/env python3
"""End-to-end driver: the real `e2b` Python SDK's volumes against abx-proxy.

Run with E2B_API_KEY, E2B_API_URL and E2B_VOLUME_API_URL set (the test sets them to the
proxy). A volume is made and destroyed on the control plane (with the key); its contents
are written, read and removed with the volume's own token. Prints one line per step;
exits 1 with a message naming the failed step.
"""


from e2b_driver import expect, ok, require_env, run, step


def main():
    require_env("E2B_API_KEY", "E2B_API_URL", "E2B_VOLUME_API_URL")

    from importlib.metadata import version

    from e2b import Volume, VolumePathNotFoundException

    print(f"e2b python SDK {version('e2b')} (volumes)", flush=True)

    step("Volume.create")
    vol = Volume.create("e2e-volume")
    expect(vol.volume_id and vol.token, "no volume id or token")
    ok(vol.volume_id)

    path = "/dir a/ü.txt"
    step("write_file (the volume's token)")
    entry = vol.write_file(path, "hello volume")
    expect(entry.path == path, f"write returned path {entry.path!r}")
    ok(f"{entry.size} bytes")

    step("Volume.connect, read_file")
    again = Volume.connect(vol.volume_id)
    text = again.read_file(path)
    expect(text == "hello volume", f"read {text!r}")
    ok(repr(text))

    step("remove, then read_file is not found")
    vol.remove(path)
    try:
        vol.read_file(path)
        raise AssertionError("read a removed file")
    except VolumePathNotFoundException:
        pass
    ok("not found")

    step("Volume.destroy")
    expect(Volume.destroy(vol.volume_id) is True, "destroy did not return True")
    ok("destroyed")


if __name__ == "__main__":
    run(main, "PASS python volumes")
