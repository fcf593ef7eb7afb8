// Against the live service over mTLS: run by tests/integration/test_ts_client.py, which
// starts the service, creates the thread and passes the files in the environment.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { test } from "node:test";
import { HandshakeFailed, StaleVersion, ZtateClient, ZtateError } from "../src/index.js";
import { Code } from "@connectrpc/connect";

const env = process.env;
const live = env.ZTATE_TARGET !== undefined;
const THREAD = env.ZTATE_THREAD ?? "";

function node(): ZtateClient {
  return ZtateClient.fromFiles({
    target: env.ZTATE_TARGET!,
    certFile: env.ZTATE_CERT!,
    keyFile: env.ZTATE_KEY!,
    caFile: env.ZTATE_CA!,
  });
}

const ACTION = { requested_action: { action: "lookup", order_id: "A-42" } };

test("a node reads its view, proposes, and is refused typed", { skip: !live }, async (t) => {
  const client = node();
  const view = await client.getView(THREAD);
  assert.equal(view.version, 0n);
  assert.deepEqual(Object.keys(view.state), ["raw_text"]);
  assert.equal(view.headDigest, "", "an unmarked node is told no digest");

  const key = randomUUID();
  const committed = await client.propose(THREAD, view.version, ACTION, key);
  assert.equal(committed.kind, "committed");
  assert.ok(committed.kind === "committed" && committed.transition.version === 1n);

  await t.test("a retry with the same key replays the outcome", async () => {
    const again = await client.propose(THREAD, view.version, ACTION, key);
    assert.ok(again.kind === "committed" && again.replayed && again.transition.version === 1n);
  });

  await t.test("a stale version carries the head", async () => {
    await assert.rejects(client.propose(THREAD, 0, ACTION), (error: unknown) => {
      assert.ok(error instanceof StaleVersion);
      assert.equal(error.reason, "STALE_VERSION");
      assert.equal(error.code, Code.Aborted);
      assert.equal(error.currentVersion, 1n);
      return true;
    });
  });

  await t.test("a protected key names the key, nothing committed", async () => {
    await assert.rejects(client.propose(THREAD, 1, { is_admin: true }), (error: unknown) => {
      assert.ok(error instanceof ZtateError);
      assert.equal(error.code, Code.PermissionDenied);
      assert.equal(error.reason, "KEY_NOT_WRITABLE");
      assert.deepEqual(error.keys, ["is_admin"]);
      assert.equal(error.keysTotal, 1);
      return true;
    });
    assert.equal((await client.getView(THREAD)).version, 1n);
  });

  await t.test("watch sends every version from genesis, then stops when aborted", async () => {
    const stop = new AbortController();
    const seen: bigint[] = [];
    for await (const event of client.watch(THREAD, -1, stop.signal)) {
      seen.push(event.version);
      assert.ok(event.state !== null && "raw_text" in event.state);
      if (event.version === 1n) stop.abort();
    }
    assert.deepEqual(seen, [0n, 1n]);
  });

  await t.test("a record is refused to an unmarked node", async () => {
    await assert.rejects(client.getRecord(THREAD), (error: unknown) => {
      assert.ok(error instanceof ZtateError);
      assert.equal(error.reason, "ROLE_FORBIDDEN");
      return true;
    });
  });
});

test("a certificate of another CA gets a handshake hint, not 'server down'", { skip: !live }, async () => {
  const stranger = ZtateClient.fromFiles({
    target: env.ZTATE_TARGET!,
    certFile: env.ZTATE_FOREIGN_CERT!,
    keyFile: env.ZTATE_FOREIGN_KEY!,
    caFile: env.ZTATE_CA!,
  });
  await assert.rejects(stranger.getView(THREAD), (error: unknown) => {
    assert.ok(error instanceof HandshakeFailed, String(error));
    assert.match(error.hint, /certificate/);
    return true;
  });
});

test("a key that is not the certificate's is caught before any call", { skip: !live }, () => {
  assert.throws(
    () =>
      ZtateClient.fromFiles({
        target: env.ZTATE_TARGET!,
        certFile: env.ZTATE_CERT!,
        keyFile: env.ZTATE_FOREIGN_KEY!,
        caFile: env.ZTATE_CA!,
      }),
    HandshakeFailed,
  );
});
