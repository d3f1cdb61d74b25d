// What the E2B SDK drivers share: named steps printed one line each, and one way to fail.
//
// A driver calls `requireEnv(...)`, then `step(name)` before each step and `ok(msg)` after
// it, and hands its `main` to `run`, which prints `FAIL <step>: …` (the line the Rust tests
// show) and exits 1 on any exception, or prints its PASS line.

import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'

let STEP = 'import'
export const step = (name) => {
  STEP = name
}
export const ok = (msg) => console.log(`ok   ${STEP}: ${msg}`)
export const expect = (cond, msg) => {
  if (!cond) throw new Error(msg)
}

export const requireEnv = (...names) => {
  for (const v of names) {
    if (!process.env[v]) throw new Error(`${v} must be set`)
  }
}

// The installed version of a package in this directory's node_modules.
const require = createRequire(import.meta.url)
export const version = (pkg) =>
  JSON.parse(readFileSync(require.resolve(`${pkg}/package.json`), 'utf8')).version

// Runs `steps(...args)`; a step that fails does not leave the sandbox behind.
export async function killingOnFailure(sbx, steps, ...args) {
  try {
    await steps(...args)
  } catch (e) {
    await sbx.kill().catch(() => {})
    throw e
  }
}

export async function run(main, passed) {
  try {
    await main()
    console.log(passed)
  } catch (e) {
    console.error(e)
    console.error(`FAIL ${STEP}: ${e?.name ?? 'Error'}: ${e?.message ?? e}`)
    process.exit(1)
  }
}
