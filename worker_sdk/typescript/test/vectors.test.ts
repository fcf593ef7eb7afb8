// The files of tests/vectors/ that ztate.contract's tests run too: the TypeScript
// checks must give each the same verdict as the Python ones.
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { checkReceiptBinds as bindsReceipt, parseTime, parseTimeMicros } from "../src/evidence.js";
import {
  canonicalize,
  checkCheckpointBinds,
  ed25519PublicKey,
  parseRecord,
  sha256Hex,
  transitionDigest,
  verifyCheckpoint,
  verifyReceipt,
  type Json,
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

// --- what the Python implementation refuses, this one refuses too (a differential review) ---

test("canonicalize refuses integers I-JSON cannot carry exactly, and lone surrogates", () => {
  for (const value of [9007199254740992, -9007199254740992, 1e20, 123456789012345680000]) {
    assert.throws(() => canonicalize({ a: value }), /form: an integer is beyond/, String(value));
  }
  for (const [value, text] of [
    [9007199254740991, '{"a":9007199254740991}'],
    [1e21, '{"a":1e+21}'],
    [0.5, '{"a":0.5}'],
  ] as const) {
    assert.equal(canonicalize({ a: value }), text);
  }
  const lone: Json[] = [{ a: "\ud800" }, { a: "x\udfffy" }, { "\ud800": 1 }, ["\udc00\ud800"]];
  for (const value of lone) {
    assert.throws(() => canonicalize(value), /form: a string holds a lone surrogate/);
  }
  assert.equal(canonicalize({ a: "\ud83d\ude00" }), '{"a":"\u{1F600}"}');
});

test("times are compared to the microsecond, and years before 100 are read as written", () => {
  assert.equal(parseTimeMicros("2026-01-02T03:04:05.900000Z")! - parseTimeMicros("2026-01-02T03:04:05.500000Z")!, 400_000n);
  assert.equal(parseTime("0050-06-01T00:00:00.000000Z"), Date.parse("0050-06-01T00:00:00.000Z"));
  assert.equal(parseTime("2026-02-29T00:00:00.000000Z"), null);
  // a genuine record (committed at ...03:05:00.000007Z) and receipts binding it, valid
  // from or until a microsecond either side of the commit
  const [c] = cases("transition-digests").filter((v) => v.name === "format-2-valid");
  const record = parseRecord(encoder.encode(c!.record_json));
  assert.equal(record.committed_at, "2026-01-02T03:05:00.000007Z");
  const binds = (issued: string, expires: string) => () => {
    const receipt = {
      thread_id: record.thread_id as string,
      base_version: (record.version as number) - 1,
      decision: "approve",
      transition_digest: transitionDigest(record, c!.risk_rules),
      issued_at: issued,
      expires_at: expires,
    };
    const receiptJson = encoder.encode(JSON.stringify(receipt));
    bindsReceipt(receipt, receiptJson, { ...record, receipt_digest: sha256Hex(receiptJson) }, c!.risk_rules);
  };
  // issued a microsecond after the commit: it did not authorise it
  assert.throws(binds("2026-01-02T03:05:00.000008Z", "2026-01-02T04:00:00.000000Z"), /receipt\.expired/);
  // expiring a microsecond after it: it did
  binds("2026-01-02T03:00:00.000000Z", "2026-01-02T03:05:00.000008Z")();
  binds("2026-01-02T03:05:00.000007Z", "2026-01-02T04:00:00.000000Z")();
  assert.throws(binds("2026-01-02T03:00:00.000000Z", "2026-01-02T03:05:00.000007Z"), /receipt\.expired/);
});
