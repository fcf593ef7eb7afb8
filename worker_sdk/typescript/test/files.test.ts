// Our own certificate, key and CA files that Node cannot use are refused by fromFiles
// before any call, as the Python SDK refuses them (own_certificate): HandshakeFailed
// with reason KEY_UNUSABLE, CERTIFICATE_UNUSABLE or CA_UNUSABLE and a hint that names
// the file and why, never its content; not Node's own error. Real files: a P-256 key
// pair from node:crypto and a certificate it signs for itself (DER written here: Node
// cannot make certificates), in a folder of the test's own.
import assert from "node:assert/strict";
import { createPublicKey, generateKeyPairSync, type KeyObject, sign } from "node:crypto";
import { mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import { Code } from "@connectrpc/connect";
import { EvidenceInvalid, HandshakeFailed, loadPublicKeys, ZtateClient } from "../src/index.js";

function der(tag: number, ...body: Buffer[]): Buffer {
  const content = Buffer.concat(body);
  const size = content.length;
  if (size < 0x80) return Buffer.concat([Buffer.from([tag, size]), content]);
  const length = Buffer.from(size.toString(16).padStart(size > 0xff ? 4 : 2, "0"), "hex");
  return Buffer.concat([Buffer.from([tag, 0x80 | length.length]), length, content]);
}
const oid = (hex: string): Buffer => der(0x06, Buffer.from(hex, "hex"));
const ECDSA_WITH_SHA256 = der(0x30, oid("2a8648ce3d040302")); // 1.2.840.10045.4.3.2
const COMMON_NAME = oid("550403"); // 2.5.4.3

/** A self-signed certificate for `key` (X.509 v3, ECDSA with SHA-256), valid for a day either side of now, as PEM. */
function selfSigned(key: KeyObject, name: string): string {
  const utc = (at: number): Buffer => der(0x17, Buffer.from(new Date(at).toISOString().replace(/[-:T]|\.\d+/g, "").slice(2)));
  const subject = der(0x30, der(0x31, der(0x30, COMMON_NAME, der(0x0c, Buffer.from(name)))));
  const day = 24 * 3600 * 1000;
  const tbs = der(
    0x30,
    der(0xa0, der(0x02, Buffer.from([2]))), // v3
    der(0x02, Buffer.from([1])),
    ECDSA_WITH_SHA256,
    subject,
    der(0x30, utc(Date.now() - day), utc(Date.now() + day)),
    subject,
    createPublicKey(key).export({ type: "spki", format: "der" }),
  );
  const signature = der(0x03, Buffer.from([0]), sign("sha256", tbs, key));
  const body = der(0x30, tbs, ECDSA_WITH_SHA256, signature).toString("base64").replace(/.{64}/g, "$&\n");
  return `-----BEGIN CERTIFICATE-----\n${body}\n-----END CERTIFICATE-----\n`.replace(/\n\n/g, "\n");
}

const folder = mkdtempSync(join(tmpdir(), "ztate-files-"));
after(() => rmSync(folder, { recursive: true, force: true }));

const { privateKey } = generateKeyPairSync("ec", { namedCurve: "P-256" });
const CERT = selfSigned(privateKey, "ztate-worker");
const KEY = privateKey.export({ type: "pkcs8", format: "pem" }) as string;
// the same key, encrypted with a password
const ENCRYPTED = privateKey.export({ type: "pkcs8", format: "pem", cipher: "aes-256-cbc", passphrase: "a password" }) as string;
const NOT_PEM = "not PEM at all: ztate-secret-content\n";

/** fromFiles over files holding these contents (the certificate is its own CA). */
function fromFiles(contents: { cert?: string; key?: string; ca?: string }): ZtateClient {
  const files = { cert: CERT, key: KEY, ca: CERT, ...contents };
  const paths = Object.fromEntries(
    Object.entries(files).map(([name, content]) => {
      const path = join(folder, `${name}-${Math.random().toString(16).slice(2)}.pem`);
      writeFileSync(path, content, { mode: 0o600 });
      return [name, path];
    }),
  );
  return ZtateClient.fromFiles({ target: "localhost:1", certFile: paths.cert!, keyFile: paths.key!, caFile: paths.ca! });
}

test("usable files make a client (the files of these tests are sound but for the one each breaks)", () => {
  assert.ok(fromFiles({}) instanceof ZtateClient);
});

const UNUSABLE: [string, { cert?: string; key?: string; ca?: string }, string, string][] = [
  ["a key encrypted with a password", { key: ENCRYPTED }, "KEY_UNUSABLE", "the key file is encrypted with a password: ztate reads private keys without one"],
  ["a key that is not PEM", { key: NOT_PEM }, "KEY_UNUSABLE", "the key file is not a PEM private key"],
  ["a certificate that is not PEM", { cert: NOT_PEM }, "CERTIFICATE_UNUSABLE", "the certificate file is not a PEM certificate"],
  ["a CA file that is not PEM", { ca: NOT_PEM }, "CA_UNUSABLE", "the CA file is not a PEM certificate bundle"],
  [
    "a usable key that is another certificate's",
    { key: generateKeyPairSync("ec", { namedCurve: "P-256" }).privateKey.export({ type: "pkcs8", format: "pem" }) as string },
    "KEY_MISMATCH",
    "the key file is not the private key of the certificate file",
  ],
];

for (const [name, contents, reason, hint] of UNUSABLE) {
  test(`fromFiles refuses ${name}: HandshakeFailed ${reason}, naming the file, never its content`, () => {
    assert.throws(
      () => fromFiles(contents),
      (error: unknown) => {
        assert.ok(error instanceof HandshakeFailed, `${String(error)} is not a HandshakeFailed`);
        assert.equal(error.reason, reason);
        assert.equal(error.code, Code.Unavailable);
        assert.equal(error.hint, hint);
        assert.equal(error.cause, undefined, "Node's error is not kept");
        const shown = `${error.message} ${error.stack ?? ""}`;
        assert.doesNotMatch(shown, /ztate-secret-content|PRIVATE KEY|BEGIN/, "no content of the file");
        return true;
      },
    );
  });
}

for (const [name, option, kind] of [
  ["certificate", "certFile", "a certificate"],
  ["key", "keyFile", "a private key"],
  ["CA", "caFile", "a CA bundle"],
] as const) {
  test(`fromFiles reads a ${name} file that never ends (a link to /dev/zero) to its bound, and refuses it naming the file`, () => {
    const files = { cert: CERT, key: KEY, ca: CERT };
    const paths: Record<string, string> = {};
    for (const [which, content] of Object.entries(files)) {
      paths[which] = join(folder, `${which}-${Math.random().toString(16).slice(2)}.pem`);
      writeFileSync(paths[which]!, content, { mode: 0o600 });
    }
    const endless = join(folder, `endless-${Math.random().toString(16).slice(2)}.pem`);
    symlinkSync("/dev/zero", endless);
    const options = { target: "localhost:1", certFile: paths.cert!, keyFile: paths.key!, caFile: paths.ca!, [option]: endless };
    assert.throws(
      () => ZtateClient.fromFiles(options),
      (error: unknown) => {
        assert.ok(error instanceof RangeError, `${String(error)} is not a RangeError`);
        assert.match(error.message, new RegExp(`^${endless}: more than [0-9,]+ bytes, too large for ${kind}$`));
        return true;
      },
    );
  });
}

test("loadPublicKeys reads a file that never ends to its bound: EvidenceInvalid keys.file", () => {
  const endless = join(folder, `keys-${Math.random().toString(16).slice(2)}.json`);
  symlinkSync("/dev/zero", endless);
  assert.throws(
    () => loadPublicKeys(endless),
    (error: unknown) => {
      assert.ok(error instanceof EvidenceInvalid, `${String(error)} is not an EvidenceInvalid`);
      assert.equal(error.check, "keys.file");
      return true;
    },
  );
});
