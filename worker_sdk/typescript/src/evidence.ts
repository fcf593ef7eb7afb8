/**
 * The byte formats a worker checks before it acts, as ztate.contract (the one Python
 * implementation) defines them: RFC 8785 canonical JSON, the transition digest rebuilt
 * from a record and its risk rules, approval receipts and signed checkpoints (Ed25519).
 * tests/vectors/ holds the files both implementations must agree on.
 */
import { createHash, createPublicKey, verify, type KeyObject } from "node:crypto";
import { MAX_PEM_FILE_BYTES, readBounded } from "./files.js";

/** A check before acting failed; `check` names which (as the Python SDK's HeadNotVerified). */
export class EvidenceInvalid extends Error {
  constructor(
    readonly check: string,
    message: string,
  ) {
    super(`${check}: ${message}`);
    this.name = "EvidenceInvalid";
  }
}

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };
export type JsonObject = { [key: string]: Json };

const HEX_256 = /^[0-9a-f]{64}$/;
const NONCE = /^[0-9a-f]{32}$/;
const TIME = /^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})Z$/;
const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

/**
 * RFC 8785 (JCS): members sorted by their UTF-16 code units, no whitespace, strings
 * and numbers as ECMAScript's JSON.stringify writes them (which is what JCS specifies).
 */
export function canonicalize(value: Json): string {
  if (value === null || typeof value !== "object") {
    if (typeof value === "number") {
      if (!Number.isFinite(value)) throw new EvidenceInvalid("form", "a number is not finite");
      // written without an exponent, such an integer is one I-JSON cannot carry exactly
      // (RFC 7493): the Python implementation refuses it, so this one does too
      const size = Math.abs(value);
      if (Number.isInteger(value) && size > Number.MAX_SAFE_INTEGER && size < 1e21) {
        throw new EvidenceInvalid("form", "an integer is beyond ±(2^53 - 1)");
      }
    }
    if (typeof value === "string") wellFormed(value);
    return JSON.stringify(value);
  }
  if (Array.isArray(value)) {
    return `[${value.map(canonicalize).join(",")}]`;
  }
  const names = Object.keys(value).sort();
  return `{${names.map((name) => `${JSON.stringify(wellFormed(name))}:${canonicalize(value[name] as Json)}`).join(",")}}`;
}

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/** `text`, unless it holds a lone surrogate (no Unicode text, which I-JSON refuses). */
function wellFormed(text: string): string {
  if (LONE_SURROGATE.test(text)) throw new EvidenceInvalid("form", "a string holds a lone surrogate");
  return text;
}

export function canonicalBytes(value: Json): Uint8Array {
  return encoder.encode(canonicalize(value));
}

export function sha256Hex(data: Uint8Array | string): string {
  return createHash("sha256").update(data).digest("hex");
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && a.every((byte, i) => byte === b[i]);
}

/** Exact bytes that must be the canonical JSON of an object: parsed, or `check` fails. */
function parseCanonical(data: Uint8Array, check: string, what: string): JsonObject {
  let parsed: unknown;
  try {
    parsed = JSON.parse(decoder.decode(data));
  } catch {
    throw new EvidenceInvalid(check, `the ${what} is not UTF-8 JSON`);
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw new EvidenceInvalid(check, `the ${what} is not a JSON object`);
  }
  if (!sameBytes(canonicalBytes(parsed as JsonObject), data)) {
    throw new EvidenceInvalid(check, `the ${what} is not in canonical (RFC 8785) form`);
  }
  return parsed as JsonObject;
}

function hasExactly(body: JsonObject, members: readonly string[]): boolean {
  const names = Object.keys(body);
  return names.length === members.length && members.every((m) => Object.hasOwn(body, m));
}

/** A time exactly as ztate writes it (UTC, six fraction digits, a Z), in ms; or null. */
export function parseTime(text: Json | undefined): number | null {
  const micros = parseTimeMicros(text);
  return micros === null ? null : Number(micros / 1000n);
}

/**
 * A time exactly as ztate writes it, in µs since the epoch (a bigint: past 2^53), or
 * null: what validity windows are compared in, to the microsecond, as Python does.
 */
export function parseTimeMicros(text: Json | undefined): bigint | null {
  if (typeof text !== "string") return null;
  const m = TIME.exec(text);
  if (m === null) return null;
  const [year, month, day, hour, minute, second, micro] = m.slice(1, 8).map(Number) as number[];
  const at = new Date(0);
  // setUTCFullYear, not Date.UTC, which reads the years 0 to 99 as 1900 to 1999
  at.setUTCFullYear(year!, month! - 1, day!);
  at.setUTCHours(hour!, minute!, second!, 0);
  if (at.getUTCFullYear() !== year || at.getUTCMonth() !== month! - 1 || at.getUTCDate() !== day) {
    return null;
  }
  return hour! < 24 && minute! < 60 && second! < 60 ? BigInt(at.getTime()) * 1000n + BigInt(micro!) : null;
}

function isInt(value: Json | undefined): value is number {
  return typeof value === "number" && Number.isSafeInteger(value);
}

/** An Ed25519 public key from its 32 raw bytes (what ztate's public key files hold, base64). */
export function ed25519PublicKey(raw: Uint8Array): KeyObject {
  return createPublicKey({
    key: { kty: "OKP", crv: "Ed25519", x: Buffer.from(raw).toString("base64url") },
    format: "jwk",
  });
}

/** Public keys by key id. */
export type PublicKeys = ReadonlyMap<string, KeyObject>;

const KEY_ID = /^[A-Za-z0-9._-]{1,64}$/;

/**
 * A public keyring file, as `ztate` writes them (keys/approval-public.json, the
 * checkpoint public keys): `{"<key id>": "<base64 of the raw 32-byte Ed25519 key>"}`,
 * non-empty. Throws EvidenceInvalid("keys.file") naming what is wrong.
 */
export function loadPublicKeys(path: string): PublicKeys {
  let doc: unknown;
  try {
    doc = JSON.parse(readBounded(path, MAX_PEM_FILE_BYTES, "public keys").toString("utf8"));
  } catch {
    throw new EvidenceInvalid("keys.file", `${path}: public keys must be a readable JSON object`);
  }
  if (typeof doc !== "object" || doc === null || Array.isArray(doc) || Object.keys(doc).length === 0) {
    throw new EvidenceInvalid("keys.file", `${path}: public keys must be a non-empty JSON object`);
  }
  const keys = new Map<string, KeyObject>();
  for (const [keyId, encoded] of Object.entries(doc)) {
    if (!KEY_ID.test(keyId)) {
      throw new EvidenceInvalid("keys.file", `${path}: key id ${JSON.stringify(keyId)} must be 1-64 characters of [A-Za-z0-9._-]`);
    }
    const raw = typeof encoded === "string" && /^[A-Za-z0-9+/]*={0,2}$/.test(encoded) ? Buffer.from(encoded, "base64") : null;
    if (raw === null || raw.length !== 32) {
      throw new EvidenceInvalid("keys.file", `${path}: key ${JSON.stringify(keyId)} is not a base64 Ed25519 public key`);
    }
    keys.set(keyId, ed25519PublicKey(raw));
  }
  return keys;
}

function checkSignature(
  data: Uint8Array,
  signatureHex: string,
  keyId: string,
  keys: PublicKeys,
  check: string,
  what: string,
): void {
  const key = keys.get(keyId);
  if (key === undefined) {
    throw new EvidenceInvalid(check, `no ${what} public key has id ${JSON.stringify(keyId)}`);
  }
  const signature = /^([0-9a-f]{2})*$/.test(signatureHex) ? Buffer.from(signatureHex, "hex") : null;
  if (signature === null || !verify(null, data, key, signature)) {
    throw new EvidenceInvalid(check, "the Ed25519 signature does not verify");
  }
}

const RECORD_MEMBERS = [
  "format", "kind", "thread_id", "version", "parent_digest", "node_id", "patch",
  "state_digest", "policy_digest", "receipt_digest", "key_id", "committed_at",
] as const;

/** Format 2 adds the names of the risk rules the transition matched, sorted. */
const RECORD_MEMBERS_2 = [...RECORD_MEMBERS, "risk_rules"] as const;

function sortedDistinctNames(rules: Json | undefined): boolean {
  if (!Array.isArray(rules) || !rules.every((rule) => typeof rule === "string")) return false;
  const names = rules as string[];
  return names.every((name, i) => i === 0 || (names[i - 1] as string) < name);
}

/**
 * Ledger record bytes (Transition.record_json), parsed once their form checks out:
 * format 1, or format 2 with the matched risk rule names (docs/ledger-format.md).
 */
export function parseRecord(recordJson: Uint8Array): JsonObject {
  const record = parseCanonical(recordJson, "record.form", "record");
  const r = record;
  const ok =
    ((r.format === 1 && hasExactly(r, RECORD_MEMBERS)) ||
      (r.format === 2 && hasExactly(r, RECORD_MEMBERS_2) && sortedDistinctNames(r.risk_rules))) &&
    isInt(r.version) &&
    r.version >= 0 &&
    typeof r.kind === "string" &&
    (r.version === 0 ? r.kind === "genesis" : r.kind === "transition" || r.kind === "revert") &&
    typeof r.thread_id === "string" &&
    typeof r.node_id === "string" &&
    typeof r.key_id === "string" &&
    typeof r.policy_digest === "string" &&
    r.patch !== null && typeof r.patch === "object" && !Array.isArray(r.patch) &&
    typeof r.parent_digest === "string" && HEX_256.test(r.parent_digest) &&
    typeof r.state_digest === "string" && HEX_256.test(r.state_digest) &&
    (r.receipt_digest === null || (typeof r.receipt_digest === "string" && HEX_256.test(r.receipt_digest))) &&
    parseTime(r.committed_at) !== null;
  if (!ok) throw new EvidenceInvalid("record.form", "the record does not have the form of format 1 or 2");
  return record;
}

/**
 * The transition digest a reviewer approved, rebuilt from a committed record and the
 * risk rules its proposal matched (GetTransitionResponse.risk_rules, in any order:
 * they are sorted here), as docs/policy.md defines it. A format-2 record carries its
 * rules: pass null (or nothing) to take them from the record.
 */
export function transitionDigest(
  record: JsonObject,
  riskRules: readonly string[] | null = null,
): string {
  if (riskRules === null) {
    if (record.format !== 2 || !Array.isArray(record.risk_rules)) {
      throw new EvidenceInvalid("record.form", "a format 1 record carries no risk rules: pass them");
    }
    riskRules = record.risk_rules as string[];
  }
  const proposal: JsonObject = {
    format: 1,
    kind: "proposal",
    thread_id: record.thread_id as Json,
    base_version: (record.version as number) - 1,
    parent_digest: record.parent_digest as Json,
    node_id: record.node_id as Json,
    patch: record.patch as Json,
    state_digest: record.state_digest as Json,
    policy_digest: record.policy_digest as Json,
    risk_rules: [...riskRules].sort(),
  };
  return sha256Hex(canonicalBytes(proposal));
}

/** Signed bytes, as SignedReceipt and SignedCheckpoint carry them. */
export interface Signed {
  /** The exact signed bytes. */
  readonly json: Uint8Array;
  /** Ed25519 signature, lower-case hex. */
  readonly signature: string;
  readonly keyId: string;
}

const RECEIPT_MEMBERS = [
  "format", "kind", "transition_digest", "thread_id", "base_version", "decision",
  "reviewers", "issued_at", "expires_at", "nonce", "key_id",
] as const;

/** An approval receipt's content, once its signature and form check out (docs/approvals.md). */
export function verifyReceipt(signed: Signed, keys: PublicKeys): JsonObject {
  checkSignature(signed.json, signed.signature, signed.keyId, keys, "receipt.signature", "approval");
  const r = parseCanonical(signed.json, "receipt.form", "receipt");
  const ok =
    hasExactly(r, RECEIPT_MEMBERS) &&
    r.format === 1 &&
    r.kind === "approval_receipt" &&
    r.key_id === signed.keyId &&
    (r.decision === "approve" || r.decision === "reject") &&
    typeof r.transition_digest === "string" && HEX_256.test(r.transition_digest) &&
    typeof r.thread_id === "string" &&
    isInt(r.base_version) &&
    Array.isArray(r.reviewers) && r.reviewers.every((x) => typeof x === "string") &&
    typeof r.nonce === "string" && NONCE.test(r.nonce) &&
    parseTime(r.issued_at) !== null &&
    parseTime(r.expires_at) !== null;
  if (!ok) throw new EvidenceInvalid("receipt.form", "the receipt does not have the form of format 1");
  return r;
}

/**
 * The verified receipt approves exactly this record: the record names its digest, it
 * binds the record's thread, base version and rebuilt transition digest with the
 * decision to approve, and it was valid when the record was committed.
 */
export function checkReceiptBinds(
  receipt: JsonObject,
  receiptJson: Uint8Array,
  record: JsonObject,
  riskRules: readonly string[],
): void {
  if (record.receipt_digest !== sha256Hex(receiptJson)) {
    throw new EvidenceInvalid("receipt.digest", "the record names another receipt");
  }
  const expected: JsonObject = {
    thread_id: record.thread_id as Json,
    base_version: (record.version as number) - 1,
    decision: "approve",
    transition_digest: transitionDigest(record, riskRules),
  };
  for (const [name, value] of Object.entries(expected)) {
    if (receipt[name] !== value) {
      throw new EvidenceInvalid("receipt.binding", `the receipt binds another ${name}`);
    }
  }
  const committed = parseTimeMicros(record.committed_at);
  const issued = parseTimeMicros(receipt.issued_at);
  const expires = parseTimeMicros(receipt.expires_at);
  if (committed === null || issued === null || expires === null || !(issued <= committed && committed < expires)) {
    throw new EvidenceInvalid("receipt.expired", "the receipt was not valid when the record was committed");
  }
}

const CHECKPOINT_MEMBERS = [
  "format", "kind", "thread_id", "version", "head_digest", "signed_at", "key_id",
] as const;

/** A signed checkpoint's content, once its signature and form check out (docs/verification.md). */
export function verifyCheckpoint(signed: Signed, keys: PublicKeys): JsonObject {
  checkSignature(signed.json, signed.signature, signed.keyId, keys, "checkpoint.signature", "checkpoint");
  const c = parseCanonical(signed.json, "checkpoint.form", "checkpoint");
  const ok =
    hasExactly(c, CHECKPOINT_MEMBERS) &&
    c.format === 1 &&
    c.kind === "checkpoint" &&
    c.key_id === signed.keyId &&
    typeof c.thread_id === "string" &&
    isInt(c.version) && c.version >= 0 &&
    typeof c.head_digest === "string" && HEX_256.test(c.head_digest) &&
    parseTime(c.signed_at) !== null;
  if (!ok) throw new EvidenceInvalid("checkpoint.form", "the checkpoint does not have the form of format 1");
  return c;
}

/** The verified checkpoint names exactly this head. */
export function checkCheckpointBinds(
  checkpoint: JsonObject,
  head: { threadId: string; version: bigint | number; digest: string },
): void {
  if (
    checkpoint.thread_id !== head.threadId ||
    BigInt(checkpoint.version as number) !== BigInt(head.version) ||
    checkpoint.head_digest !== head.digest
  ) {
    throw new EvidenceInvalid("checkpoint.head", "the signed checkpoint names another head");
  }
}
