#!/usr/bin/env node
// End-to-end driver: the real `e2b` JS SDK against abx-proxy or the fake.
//
// Run with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set (the test sets them to the
// proxy). Prints one line per step; exits 1 with a message naming the failed step.
// E2B_JS_PACKAGE selects the installed package: `e2b` (latest, default) or `e2b-250`
// (e2b 2.50.0, which uses POST /sandboxes instead of POST /v2/sandboxes).

import { expect, killingOnFailure, ok, requireEnv, run, step, version } from './e2b_driver.mjs'

async function main() {
  requireEnv('E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL')
  const pkg = process.env.E2B_JS_PACKAGE || 'e2b'
  const { Sandbox } = await import(pkg)
  console.log(`e2b js SDK ${version(pkg)} (package ${pkg}), node ${process.version}`)

  step('create')
  const sbx = await Sandbox.create('base', { timeoutMs: 60_000, metadata: { k: 'v' } })
  const sid = sbx.sandboxId
  expect(sid, 'no sandbox id')
  ok(sid)

  await killingOnFailure(sbx, runSteps, Sandbox, sbx, sid)
}

async function runSteps(Sandbox, sbx, sid) {
  step('commands.run echo hi')
  let r = await sbx.commands.run('echo hi')
  expect(r.stdout === 'hi\n', `stdout is ${JSON.stringify(r.stdout)}, expected "hi\\n"`)
  expect(r.exitCode === 0, `exit code ${r.exitCode}`)
  ok(JSON.stringify(r.stdout))

  step('commands.run whoami as root (client Basic auth kept)')
  r = await sbx.commands.run('whoami', { user: 'root' })
  expect(r.stdout === 'root\n', `stdout is ${JSON.stringify(r.stdout)}, expected "root\\n"`)
  ok(JSON.stringify(r.stdout))

  step('commands.run whoami (default user)')
  r = await sbx.commands.run('whoami')
  expect(r.stdout === 'user\n', `stdout is ${JSON.stringify(r.stdout)}, expected "user\\n"`)
  ok(JSON.stringify(r.stdout))

  const path = '/home/user/hello.txt'
  step('files.write (multipart)')
  let info = await sbx.files.write(path, 'hello world')
  expect(info.path === path, `write returned path ${JSON.stringify(info.path)}`)
  ok(info.path)

  step('files.read (text)')
  const text = await sbx.files.read(path)
  expect(text === 'hello world', `read ${JSON.stringify(text)}, expected "hello world"`)
  ok(JSON.stringify(text))

  const binPath = '/tmp/bin.dat'
  const unit = [0x00, 0x01, ...Buffer.from('binary'), 0xff]
  const payload = new Uint8Array(Array.from({ length: 1000 }, () => unit).flat())
  step('files.write (octet-stream)')
  info = await sbx.files.write(binPath, payload.buffer, { useOctetStream: true })
  expect(info.path === binPath, `write returned path ${JSON.stringify(info.path)}`)
  ok(`${payload.length} bytes`)

  step('files.read (bytes, user root)')
  const data = await sbx.files.read(binPath, { format: 'bytes', user: 'root' })
  expect(
    Buffer.from(data).equals(Buffer.from(payload)),
    `read ${data.length} bytes that differ from the upload`,
  )
  ok(`${data.length} bytes`)

  step('files.list (Connect unary ListDir)')
  const names = (await sbx.files.list('/home/user')).map((e) => e.name)
  expect(
    JSON.stringify(names) === JSON.stringify(['hello.txt']),
    `list gave ${JSON.stringify(names)}`,
  )
  ok(JSON.stringify(names))

  step('isRunning')
  expect((await sbx.isRunning()) === true, 'isRunning() is not true')
  ok('true')

  step('setTimeout')
  await sbx.setTimeout(120_000)
  ok('120 s')

  step('getInfo')
  const gi = await sbx.getInfo()
  expect(gi.sandboxId === sid, `getInfo sandboxId ${gi.sandboxId} != ${sid}`)
  expect(gi.templateId === 'base', `templateId ${gi.templateId}`)
  expect(gi.metadata?.k === 'v', `metadata ${JSON.stringify(gi.metadata)}`)
  ok(`${gi.sandboxId} template=${gi.templateId} metadata=${JSON.stringify(gi.metadata)}`)

  step('Sandbox.connect')
  const again = await Sandbox.connect(sid)
  expect(again.sandboxId === sid, `connect gave ${again.sandboxId}`)
  ok(again.sandboxId)

  step('commands.run on the connected sandbox')
  r = await again.commands.run('echo connected')
  expect(r.stdout === 'connected\n', `stdout is ${JSON.stringify(r.stdout)}`)
  ok(JSON.stringify(r.stdout))

  step('kill')
  await sbx.kill()
  ok('killed')

  step('isRunning after kill')
  expect((await sbx.isRunning()) === false, 'isRunning() is not false after kill')
  ok('false')

  step('isRunning after kill (the connected sandbox)')
  expect((await again.isRunning()) === false, 'isRunning() is not false after kill')
  ok('false')
}

await run(main, 'PASS js')
