// The files of tests/vectors/ that ztate.contract's tests run too: the TypeScript
// checks must give each the same verdict as the Python ones.
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import {
  checkCheckpointBinds,
  ed25519PublicKey,
  parseRecord,
  sha256Hex,
  transitionDigest,
  verifyCheckpoint,
  verifyReceipt,
} from "../src/index.js";

// dist/test/ -> the repository's tests/vectors/ (or ZTATE_VECTORS)
const VECTORS =
  process.env.ZTATE_VECTORS ?? join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..", "tests", "vectors");
const encoder = new TextEncoder();

type Case = Record<string, any>;

function cases(folder: string): Case[] {
  const dir = join(VECTORS, folder);
  return readdirSync(dir)
    .filter((name) => name.endsWith(".json"))
    .sort()
    .map((name) => JSON.parse(readFileSync(join(dir, name), "utf-8")) as Case);
}

function keys(c: Case) {
  return new Map([[c.key_id as string, ed25519PublicKey(Buffer.from(c.public_key_base64, "base64"))]]);
}

function accepts(check: () => unknown): boolean {
  try {
    check();
    return true;
  } catch {
    return false;
  }
}

for (const c of cases("transition-digests")) {
  test(`transition digest: ${c.name}`, () => {
    const record = parseRecord(encoder.encode(c.record_json));
    const rebuilt = transitionDigest(record, c.risk_rules);
    assert.equal(rebuilt, sha256Hex(encoder.encode(c.proposal_json)));
    assert.equal(rebuilt === c.transition_digest, c.valid, c.why);
  });
}

for (const c of cases("receipts")) {
  test(`receipt: ${c.name}`, () => {
    const signed = { json: encoder.encode(c.receipt_json), signature: c.signature, keyId: c.key_id };
    assert.equal(accepts(() => verifyReceipt(signed, keys(c))), c.valid, c.why);
  });
}

for (const c of cases("checkpoints")) {
  test(`checkpoint: ${c.name}`, () => {
    const signed = { json: encoder.encode(c.checkpoint_json), signature: c.signature, keyId: c.key_id };
    const valid = accepts(() => verifyCheckpoint(signed, keys(c)));
    assert.equal(valid, c.valid, c.why);
    const head = { threadId: c.head.thread_id, version: c.head.version, digest: c.head.digest };
    const binds = valid && accepts(() => checkCheckpointBinds(verifyCheckpoint(signed, keys(c)), head));
    assert.equal(binds, c.binds, c.why);
  });
}

test("there are vectors to run", () => {
  assert.ok(cases("transition-digests").length >= 10);
  assert.ok(cases("receipts").length >= 14);
  assert.ok(cases("checkpoints").length >= 14);
});
