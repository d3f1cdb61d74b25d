#!/usr/bin/env node
// End-to-end driver: the real `@e2b/code-interpreter` JS SDK against abx-proxy.
//
// Run with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set (the test sets them to the
// proxy). The sandbox restricts public traffic, so every request to the code interpreter's
// port (49999) carries `E2B-Traffic-Access-Token` as well as the SDK's own `X-Access-Token`
// on `/execute`. Prints one line per step; exits 1 with a message naming the failed step.

import { expect, killingOnFailure, ok, requireEnv, run, step, version } from './e2b_driver.mjs'

async function main() {
  requireEnv('E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL')
  const { Sandbox } = await import('@e2b/code-interpreter')
  console.log(
    `@e2b/code-interpreter js SDK ${version('@e2b/code-interpreter')} (e2b ${version('e2b')}), node ${process.version}`
  )

  step('create (no public traffic)')
  const sbx = await Sandbox.create({ timeoutMs: 60_000, network: { allowPublicTraffic: false } })
  expect(sbx.sandboxId, 'no sandbox id')
  expect(sbx.trafficAccessToken, 'no traffic access token in the create answer')
  ok(sbx.sandboxId)

  await killingOnFailure(sbx, runSteps, sbx)
}

async function runSteps(sbx) {
  // The fake holds the rest of the run at `wait_until_seen()` until a context is made:
  // made here on seeing the first line, which therefore came while the run went on.
  step('runCode (stdout streamed, createCodeContext on seeing it, a result)')
  const seen = []
  const made = []
  const onStdout = async (m) => {
    seen.push(m.line)
    if (!made.length) made.push(await sbx.createCodeContext())
  }
  let ex = await sbx.runCode("print('hello')\nwait_until_seen()\n40 + 2", { onStdout })
  expect(!ex.error, `error ${JSON.stringify(ex.error)}`)
  expect(JSON.stringify(ex.logs.stdout) === '["hello\\n"]', `stdout ${JSON.stringify(ex.logs.stdout)}`)
  expect(JSON.stringify(seen) === '["hello\\n"]', `onStdout saw ${JSON.stringify(seen)}`)
  expect(ex.text === '42', `result ${JSON.stringify(ex.text)}, expected "42"`)
  expect(made.length === 1 && made[0].id, `contexts made ${JSON.stringify(made)}`)
  const ctx = made[0]
  ok(`stdout ${JSON.stringify(ex.logs.stdout)}, result ${JSON.stringify(ex.text)}, context ${ctx.id}`)

  step('runCode in the context')
  ex = await sbx.runCode('1 + 2', { context: ctx })
  expect(ex.text === '3', `result ${JSON.stringify(ex.text)}, expected "3"`)
  ok(JSON.stringify(ex.text))

  step('listCodeContexts')
  const ids = (await sbx.listCodeContexts()).map((c) => c.id)
  expect(ids.includes(ctx.id), `contexts ${JSON.stringify(ids)} without ${ctx.id}`)
  ok(JSON.stringify(ids))

  step('runCode raising (the error comes back in the stream)')
  ex = await sbx.runCode('undefined_name')
  expect(ex.error, 'no error')
  expect(ex.error.name === 'NameError', `error ${JSON.stringify(ex.error.name)}`)
  ok(`${ex.error.name}: ${ex.error.value}`)

  step('removeCodeContext')
  await sbx.removeCodeContext(ctx)
  ok(ctx.id)

  step('kill')
  await sbx.kill()
  ok('killed')
}

await run(main, 'PASS js code interpreter')
