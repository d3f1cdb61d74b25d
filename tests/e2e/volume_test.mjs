#!/usr/bin/env node
// End-to-end driver: the real `e2b` JS SDK's volumes against abx-proxy.
//
// Run with E2B_API_KEY, E2B_API_URL and E2B_VOLUME_API_URL set (the test sets them to the
// proxy). A volume is made and destroyed on the control plane (with the key); its contents
// are written, read and removed with the volume's own token. Prints one line per step;
// exits 1 with a message naming the failed step.

import { expect, ok, requireEnv, run, step, version } from './e2b_driver.mjs'

async function main() {
  requireEnv('E2B_API_KEY', 'E2B_API_URL', 'E2B_VOLUME_API_URL')
  const { Volume, VolumePathNotFoundError } = await import('e2b')
  console.log(`e2b js SDK ${version('e2b')} (volumes), node ${process.version}`)

  step('Volume.create')
  const vol = await Volume.create('e2e-volume')
  expect(vol.volumeId && vol.token, 'no volume id or token')
  ok(vol.volumeId)

  const path = '/dir a/ü.txt'
  step("writeFile (the volume's token)")
  const entry = await vol.writeFile(path, 'hello volume')
  expect(entry.path === path, `write returned path ${JSON.stringify(entry.path)}`)
  ok(`${entry.size} bytes`)

  step('Volume.connect, readFile')
  const again = await Volume.connect(vol.volumeId)
  const text = await again.readFile(path)
  expect(text === 'hello volume', `read ${JSON.stringify(text)}`)
  ok(JSON.stringify(text))

  step('remove, then readFile is not found')
  await vol.remove(path)
  let missing = false
  try {
    await vol.readFile(path)
  } catch (e) {
    missing = e instanceof VolumePathNotFoundError
    if (!missing) throw e
  }
  expect(missing, 'read a removed file')
  ok('not found')

  step('Volume.destroy')
  expect((await Volume.destroy(vol.volumeId)) === true, 'destroy did not return true')
  ok('destroyed')
}

await run(main, 'PASS js volumes')
