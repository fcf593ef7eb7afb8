// The numeric options of the client and the runner are refused when given, before any
// file is read or any call made: NaN, infinities, negative, fractional and huge values
// would retry for ever, fire a timer at once or malform the gRPC deadline header.
import assert from "node:assert/strict";
import { test } from "node:test";
import { NodeRunner, ZtateClient, type ClientFiles, type RunnerOptions } from "../src/index.js";

// files that do not exist: an option refused is refused before they are read
const MISSING: ClientFiles = {
  target: "localhost:1",
  certFile: "/nonexistent/ztate-cert.pem",
  keyFile: "/nonexistent/ztate-key.pem",
  caFile: "/nonexistent/ztate-ca.pem",
};
const HUGE = 1e300;
const NOT_INTEGERS = [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY, 1.5, HUGE];

/** Asserts `make` throws `kind`, naming `option` and its range, without the value given. */
function refused(make: () => unknown, kind: typeof TypeError | typeof RangeError, option: string, range: RegExp): void {
  assert.throws(make, (error: unknown) => {
    assert.ok(error instanceof kind, `${String(error)} is not a ${kind.name}`);
    assert.match(error.message, new RegExp(`^${option} must be `));
    assert.match(error.message, range);
    assert.doesNotMatch(error.message, /e\+300|NaN|Infinity|1\.5/, "the value given is not echoed");
    return true;
  });
}

for (const [option, range] of [
  ["retries", /an integer from 0 to 20$/],
  ["backoffMs", /an integer from 0 to 60000$/],
  ["timeoutMs", /an integer from 1 to 99999999$/],
] as const) {
  test(`fromFiles refuses a ${option} that is not an integer of its range`, () => {
    for (const value of [...NOT_INTEGERS, -1, option === "timeoutMs" ? 0 : 1e9]) {
      refused(() => ZtateClient.fromFiles({ ...MISSING, [option]: value }), RangeError, option, range);
    }
    for (const value of ["3", 3n, {}, true]) {
      refused(() => ZtateClient.fromFiles({ ...MISSING, [option]: value as unknown as number }), TypeError, option, /a number, not an? /);
    }
  });
}

test("fromFiles takes the bounds of each range (then reads the files)", () => {
  for (const numbers of [
    { retries: 0, backoffMs: 0, timeoutMs: 1 },
    { retries: 20, backoffMs: 60_000, timeoutMs: 99_999_999 },
    {},
  ]) {
    assert.throws(
      () => ZtateClient.fromFiles({ ...MISSING, ...numbers }),
      (error: unknown) => (error as { code?: string }).code === "ENOENT",
      "past the options, to the missing certificate file",
    );
  }
});

test("NodeRunner refuses attempts, approvalWaitMs or stopAfter out of range", () => {
  // the constructor checks its options before it uses the client
  const client = undefined as unknown as ZtateClient;
  const runner = (options: RunnerOptions) => new NodeRunner(client, "t-1", () => null, options);
  for (const value of [...NOT_INTEGERS, 0, -1, 1001]) {
    refused(() => runner({ attempts: value }), RangeError, "attempts", /an integer from 1 to 1000$/);
  }
  for (const value of [Number.NaN, Number.POSITIVE_INFINITY, -1]) {
    refused(() => runner({ approvalWaitMs: value }), RangeError, "approvalWaitMs", /a finite number of milliseconds, 0 or more$/);
  }
  for (const value of [...NOT_INTEGERS, 0, -1]) {
    refused(() => runner({ stopAfter: value }), RangeError, "stopAfter", /an integer from 1 to \d+$/);
  }
  refused(() => runner({ attempts: "5" as unknown as number }), TypeError, "attempts", /a number, not a string$/);
  assert.ok(runner({ attempts: 1, approvalWaitMs: 0, stopAfter: 1 }) instanceof NodeRunner);
});
