// Replies the protocol does not allow, from a scripted service over mTLS (the service
// certificate of tests/integration/test_ts_client.py's CA, in the environment): a reply
// without a sub-message or oneof it must carry is EvidenceInvalid "reply.form", thrown
// at once and not retried, as the Python SDK's ProtocolError (BAD_REPLY); never a
// result of undefined fields passed on as the service's answer. So is a state that is
// not a JSON object (never JSON.parse's SyntaxError, which quotes the bytes).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { constants, createSecureServer, type ServerHttp2Session } from "node:http2";
import { type AddressInfo, type Socket } from "node:net";
import { test } from "node:test";
import { timestampFromDate } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { EvidenceInvalid, sha256Hex, ZtateClient, ZtateError } from "../src/index.js";
import { Outcome, TransitionService } from "../src/gen/ztate/v1/transition_pb.js";

const env = process.env;
const live = env.ZTATE_SERVICE_CERT !== undefined;
const THREAD = "order-42";
const AT = timestampFromDate(new Date("2026-01-02T03:04:05Z"));
const WHOLE = { threadId: THREAD, version: 4n, digest: "f".repeat(64), committedAt: AT };
const UNTIMED = { threadId: THREAD, version: 4n, digest: "f".repeat(64) };

/** What the scripted service answers each call with, and how often it was asked. */
const replies: { [call: string]: object } = {};
const asked: string[] = [];
/** The messages of the scripted service's watch stream, sent in order, then it ends. */
let watched: object[] = [];
/** Or how it answers its n-th WatchThread call (from 1), asked from a version. */
type WatchScript = (call: number, fromVersion: bigint, signal: AbortSignal) => AsyncIterable<object>;
let watchScript: WatchScript | undefined;
/** The from_version of each WatchThread call, in order. */
const watchedFrom: bigint[] = [];

function answer(call: string): object {
  asked.push(call);
  return replies[call] ?? {};
}

/** How a test breaks the scripted service's connections while it stays up. */
type Break = "destroy" | "reset" | "goaway";

async function scripted(
  backoffMs = 1,
): Promise<{ client: ZtateClient; close: () => void; breakConnections: (how: Break) => void }> {
  const server = createSecureServer(
    {
      cert: readFileSync(env.ZTATE_SERVICE_CERT!),
      key: readFileSync(env.ZTATE_SERVICE_KEY!),
      ca: readFileSync(env.ZTATE_CA!),
      requestCert: true,
      rejectUnauthorized: true,
    },
    connectNodeAdapter({
      routes: (router) =>
        router.service(TransitionService, {
          createThread: () => answer("createThread"),
          proposeTransition: () => answer("proposeTransition"),
          getTransition: () => answer("getTransition"),
          waitForOutcome: () => answer("waitForOutcome"),
          getView: () => answer("getView"),
          async *watchThread(request, context) {
            asked.push("watchThread");
            watchedFrom.push(request.fromVersion);
            if (watchScript === undefined) yield* watched;
            else yield* watchScript(watchedFrom.length, request.fromVersion, context.signal);
          },
        }),
    }),
  );
  const sessions = new Set<ServerHttp2Session>();
  server.on("session", (session: ServerHttp2Session) => sessions.add(session));
  await new Promise<void>((listening) => server.listen(0, "127.0.0.1", listening));
  const client = ZtateClient.fromFiles({
    target: `localhost:${(server.address() as AddressInfo).port}`,
    certFile: env.ZTATE_OPERATOR_CERT!,
    keyFile: env.ZTATE_OPERATOR_KEY!,
    caFile: env.ZTATE_CA!,
    backoffMs,
  });
  // the client keeps its connection: end it with the server
  return {
    client,
    close: () => (server.close(), sessions.forEach((session) => session.destroy())),
    breakConnections: (how) => {
      for (const session of sessions) {
        if (how === "destroy") session.destroy();
        else if (how === "reset") (session.socket as Socket).resetAndDestroy();
        else session.goaway(constants.NGHTTP2_INTERNAL_ERROR);
      }
      sessions.clear();
    },
  };
}

// each call that turns a reply into a result: the reply without what it must carry, the
// message thrown, and the whole reply with what its result holds
const CASES: {
  name: string;
  call: string;
  make: (client: ZtateClient) => Promise<unknown>;
  missing: object;
  message: string;
  whole: object;
  holds: (result: any) => unknown;
  expected: unknown;
}[] = [
  {
    name: "createThread without the genesis",
    call: "createThread",
    make: (client) => client.createThread(THREAD, { n: 1 }),
    missing: { replayed: true },
    message: "the service answered CreateThread without the genesis",
    whole: { genesis: { ...WHOLE, version: 0n }, replayed: true },
    holds: (created) => [created.transition.version, created.replayed],
    expected: [0n, true],
  },
  {
    name: "createThread with a genesis without its commit time",
    call: "createThread",
    make: (client) => client.createThread(THREAD, { n: 1 }),
    missing: { genesis: { ...UNTIMED, version: 0n } },
    message: "the service answered CreateThread without the genesis's committed_at",
    whole: { genesis: { ...WHOLE, version: 0n } },
    holds: (created) => created.transition.committedAt.seconds,
    expected: AT.seconds,
  },
  {
    name: "propose without the outcome",
    call: "proposeTransition",
    make: (client) => client.propose(THREAD, 3, { n: 2 }),
    missing: { replayed: true },
    message: "the service answered ProposeTransition without the outcome",
    whole: { outcome: { case: "transition", value: WHOLE }, replayed: true },
    holds: (done) => [done.kind, done.transition.version, done.replayed],
    expected: ["committed", 4n, true],
  },
  {
    name: "propose committed without the commit time",
    call: "proposeTransition",
    make: (client) => client.propose(THREAD, 3, { n: 2 }),
    missing: { outcome: { case: "transition", value: UNTIMED } },
    message: "the service answered ProposeTransition without the transition's committed_at",
    whole: { outcome: { case: "transition", value: WHOLE } },
    holds: (done) => done.transition.committedAt.seconds,
    expected: AT.seconds,
  },
  {
    name: "getRecord without the transition",
    call: "getTransition",
    make: (client) => client.getRecord(THREAD),
    missing: { riskRules: ["large-refund"] },
    message: "the service answered GetTransition without the transition",
    whole: { transition: WHOLE, riskRules: ["large-refund"] },
    holds: (found) => [found.transition.version, found.riskRules],
    expected: [4n, ["large-refund"]],
  },
  {
    name: "getRecord with a record without its commit time",
    call: "getTransition",
    make: (client) => client.getRecord(THREAD, 4),
    missing: { transition: UNTIMED },
    message: "the service answered GetTransition without the transition's committed_at",
    whole: { transition: WHOLE },
    holds: (found) => found.transition.committedAt.seconds,
    expected: AT.seconds,
  },
  {
    name: "waitForOutcome without an outcome",
    call: "waitForOutcome",
    make: (client) => client.waitForOutcome(`${THREAD}/key`, 5_000),
    missing: {},
    message: "the service answered WaitForOutcome with outcome 0",
    whole: { outcome: Outcome.REJECTED },
    holds: (outcome) => [outcome.status, outcome.transition],
    expected: ["rejected", undefined],
  },
  {
    name: "waitForOutcome committed without the transition",
    call: "waitForOutcome",
    make: (client) => client.waitForOutcome(`${THREAD}/key`, 5_000),
    missing: { outcome: Outcome.COMMITTED },
    message: "the service answered WaitForOutcome without the transition",
    whole: { outcome: Outcome.COMMITTED, transition: WHOLE },
    holds: (outcome) => [outcome.status, outcome.transition.version],
    expected: ["committed", 4n],
  },
];

test("a reply without what the protocol requires is reply.form, not retried", { skip: !live }, async (t) => {
  const { client, close } = await scripted();
  try {
    for (const c of CASES) {
      await t.test(c.name, async () => {
        replies[c.call] = c.missing;
        asked.length = 0;
        await assert.rejects(c.make(client), (error: unknown) => {
          assert.ok(error instanceof EvidenceInvalid, `${String(error)} is not EvidenceInvalid`);
          assert.equal(error.check, "reply.form");
          assert.equal(error.message, `reply.form: ${c.message}`);
          return true;
        });
        assert.deepEqual(asked, [c.call], "asked once: not retried");
        replies[c.call] = c.whole;
        assert.deepEqual(c.holds(await c.make(client)), c.expected);
      });
    }
  } finally {
    close();
  }
});

// A state as a misbehaving service or proxy might send it: the bytes, and what the error
// says of the field. Each holds "s3cret", which the error must not repeat.
const encoder = new TextEncoder();
const BAD_STATES: { name: string; bytes: Uint8Array; fault: string }[] = [
  { name: "empty", bytes: new Uint8Array(), fault: "an empty state_json" },
  { name: "cut short", bytes: encoder.encode('{"card":"s3cret'), fault: "a state_json that is not JSON" },
  {
    name: "not UTF-8",
    bytes: Uint8Array.of(...encoder.encode('{"card":"s3cret'), 0xff, ...encoder.encode('"}')),
    fault: "a state_json that is not JSON",
  },
  { name: "deeply nested", bytes: encoder.encode("[".repeat(100_000) + '"s3cret"'), fault: "a state_json that is not JSON" },
  { name: "an array", bytes: encoder.encode('["s3cret"]'), fault: "a state_json that is not a JSON object" },
  { name: "a string", bytes: encoder.encode('"s3cret"'), fault: "a state_json that is not a JSON object" },
  { name: "null", bytes: encoder.encode("null"), fault: "a state_json that is not a JSON object" },
];
const WHOLE_STATE = encoder.encode('{"n":1}');

function watchedEvent(version: bigint, stateJson: Uint8Array): object {
  return { threadId: THREAD, version, digest: "f".repeat(64), stateJson };
}

test("a state that is not a JSON object is reply.form, the bytes unsaid, a stream ended", { skip: !live }, async (t) => {
  const { client, close } = await scripted();
  const isReplyForm = (message: string) => (error: unknown) => {
    assert.ok(error instanceof EvidenceInvalid, `${String(error)} is not EvidenceInvalid`);
    assert.equal(error.check, "reply.form");
    assert.equal(error.message, `reply.form: ${message}`);
    assert.ok(!String(error.stack).includes("s3cret"), "the error repeats the bytes");
    return true;
  };
  try {
    for (const bad of BAD_STATES) {
      await t.test(`getView, ${bad.name}`, async () => {
        replies.getView = { threadId: THREAD, version: 3n, stateJson: bad.bytes };
        asked.length = 0;
        await assert.rejects(client.getView(THREAD), isReplyForm(`the service answered GetView with ${bad.fault}`));
        assert.deepEqual(asked, ["getView"], "asked once: not retried");
      });
      await t.test(`watch, ${bad.name}`, async () => {
        // a skipped message would let version 2 through and the (one) stream end normally
        watched = [watchedEvent(0n, WHOLE_STATE), watchedEvent(1n, bad.bytes), watchedEvent(2n, WHOLE_STATE)];
        asked.length = 0;
        const seen: unknown[] = [];
        const watching = (async () => {
          for await (const event of client.watch(THREAD, -1, undefined, { resume: false })) {
            seen.push([event.version, event.state]);
          }
        })();
        await assert.rejects(watching, isReplyForm(`the service answered WatchThread with ${bad.fault}`));
        assert.deepEqual(seen, [[0n, { n: 1 }]]);
        assert.deepEqual(asked, ["watchThread"]);
      });
    }
    // the replies the protocol allows are the results
    replies.getView = { threadId: THREAD, version: 3n, stateJson: WHOLE_STATE };
    const view = await client.getView(THREAD);
    assert.deepEqual([view.version, view.state], [3n, { n: 1 }]);
  } finally {
    close();
  }
});

// --- watch resumes: after a transport failure, after the server's normal end ---------

/** Resolves when the client cancels the stream (it broke out of its loop). */
function cancelled(signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve();
    signal.addEventListener("abort", () => resolve(), { once: true });
  });
}

/** The versions a watch from `from` yields until `last`, then breaks out. */
async function watchUntil(client: ZtateClient, from: bigint, last: bigint, options = {}): Promise<bigint[]> {
  const seen: bigint[] = [];
  for await (const event of client.watch(THREAD, from, undefined, options)) {
    seen.push(event.version);
    if (event.version === last) break;
  }
  return seen;
}

test("watch resumes after the last version when the stream breaks in transport", { skip: !live }, async () => {
  const { client, close } = await scripted();
  watchedFrom.length = 0;
  watchScript = async function* (call, from, signal) {
    for (let version = from + 1n; version <= (call === 1 ? 2n : 4n); version += 1n) {
      yield watchedEvent(version, WHOLE_STATE);
    }
    if (call === 1) throw new ConnectError("the server is restarting", Code.Unavailable);
    await cancelled(signal);
  };
  try {
    assert.deepEqual(await watchUntil(client, -1n, 4n), [0n, 1n, 2n, 3n, 4n], "nothing skipped, nothing repeated");
    assert.deepEqual(watchedFrom, [-1n, 2n]);
  } finally {
    watchScript = undefined;
    close();
  }
});

test("watch resumes when its connection breaks under it, the service still up", { skip: !live }, async (t) => {
  // connect-node reports these as CANCELED, ABORTED and INTERNAL, not UNAVAILABLE
  for (const how of ["destroy", "reset", "goaway"] as const) {
    await t.test(how, async () => {
      const { client, close, breakConnections } = await scripted();
      watchedFrom.length = 0;
      let sawTwo!: () => void;
      const two = new Promise<void>((resolve) => (sawTwo = resolve));
      watchScript = async function* (call, from, signal) {
        for (let version = from + 1n; version <= (call === 1 ? 2n : 4n); version += 1n) {
          yield watchedEvent(version, WHOLE_STATE);
        }
        if (call === 1) {
          await two; // the client has version 2: break its connection now
          breakConnections(how);
        }
        await cancelled(signal);
      };
      try {
        const seen: bigint[] = [];
        for await (const event of client.watch(THREAD, -1)) {
          seen.push(event.version);
          if (event.version === 2n) sawTwo();
          if (event.version === 4n) break;
        }
        assert.deepEqual(seen, [0n, 1n, 2n, 3n, 4n], "nothing skipped, nothing repeated");
        assert.deepEqual(watchedFrom, [-1n, 2n]);
      } finally {
        watchScript = undefined;
        close();
      }
    });
  }
});

test("watch resumes at once after the server ends a stream that served, never counting it", { skip: !live }, async () => {
  const { client, close } = await scripted();
  watchedFrom.length = 0;
  // one version a stream, then a normal end (the stream's lifetime): with no reconnects
  // allowed, a resume counted as a failure would throw
  watchScript = async function* (_call, from) {
    yield watchedEvent(from + 1n, WHOLE_STATE);
  };
  try {
    assert.deepEqual(await watchUntil(client, -1n, 4n, { reconnects: 0 }), [0n, 1n, 2n, 3n, 4n]);
    assert.deepEqual(watchedFrom, [-1n, 0n, 1n, 2n, 3n]);
  } finally {
    watchScript = undefined;
    close();
  }
});

test("a watch whose streams end at once with nothing throws after its reconnects", { skip: !live }, async () => {
  const { client, close } = await scripted();
  watchedFrom.length = 0;
  watchScript = async function* () {};
  try {
    await assert.rejects(watchUntil(client, 5n, 9n, { reconnects: 2 }), (error: unknown) => {
      assert.ok(error instanceof ZtateError, `${String(error)} is not a ZtateError`);
      assert.equal(error.code, Code.Unavailable);
      assert.equal(error.reason, "UNAVAILABLE");
      assert.equal(error.message, "the watch stream keeps ending");
      return true;
    });
    assert.deepEqual(watchedFrom, [5n, 5n, 5n], "the first stream and two more");
  } finally {
    watchScript = undefined;
    close();
  }
});

test("a watch throws a refusal at once, and one stream only with resume: false", { skip: !live }, async () => {
  const { client, close } = await scripted();
  watchedFrom.length = 0;
  watchScript = async function* (call) {
    if (call > 2) throw new ConnectError("the node may not watch this thread", Code.PermissionDenied);
    yield watchedEvent(0n, WHOLE_STATE);
  };
  try {
    assert.deepEqual(await watchUntil(client, -1n, 9n, { resume: false }), [0n], "one stream, then the end");
    assert.deepEqual(watchedFrom, [-1n]);
    await assert.rejects(watchUntil(client, -1n, 9n), (error: unknown) => {
      assert.ok(error instanceof ZtateError, `${String(error)} is not a ZtateError`);
      assert.equal(error.code, Code.PermissionDenied);
      return true;
    });
    assert.deepEqual(watchedFrom, [-1n, -1n, 0n], "the refusal was not asked again");
  } finally {
    watchScript = undefined;
    close();
  }
});

test("an aborted watch ends at once, a long wait to resume ahead of it", { skip: !live }, async () => {
  // a long wait before the next stream (capped at 5 s): the abort must end the watch, not the wait
  const { client, close } = await scripted(60_000);
  watchedFrom.length = 0;
  const stop = new AbortController();
  let failed!: () => void;
  const firstFailed = new Promise<void>((resolve) => (failed = resolve));
  watchScript = async function* () {
    failed();
    throw new ConnectError("the server is restarting", Code.Unavailable);
  };
  try {
    const began = performance.now();
    const watching = (async () => {
      const seen: bigint[] = [];
      for await (const event of client.watch(THREAD, -1, stop.signal)) seen.push(event.version);
      return seen;
    })();
    await firstFailed;
    stop.abort();
    assert.deepEqual(await watching, []);
    // the wait ahead is 5 s (the backoff's cap): an abort that did not end it waits it out
    assert.ok(performance.now() - began < 2_000, "the watch waited out its backoff");
    assert.deepEqual(watchedFrom, [-1n], "no stream after the abort");
  } finally {
    watchScript = undefined;
    close();
  }
});

// --- the head a worker acts on is this thread's, at this version ------------------------

test("verifyHeadBeforeActing refuses a genuine record of another thread or version", { skip: !live }, async () => {
  // a well-formed record that hashes to the digest the reply names (tests/vectors/): a
  // checkpoint signed for this thread's head at that digest would otherwise stand for it
  const vectors = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..", "tests", "vectors");
  const vector = JSON.parse(readFileSync(join(vectors, "transition-digests", "format-2-valid.json"), "utf-8"));
  const recordJson = encoder.encode(vector.record_json);
  const record = JSON.parse(vector.record_json) as { thread_id: string; version: number };
  const digest = sha256Hex(recordJson);
  const { client, close } = await scripted();
  try {
    for (const [threadId, version] of [
      ["another-thread", BigInt(record.version)],
      [record.thread_id, BigInt(record.version) + 1n],
    ] as const) {
      replies.getTransition = { transition: { threadId, version, digest, recordJson, committedAt: AT } };
      await assert.rejects(
        client.verifyHeadBeforeActing({
          threadId,
          version,
          headDigest: digest,
          actingOn: {},
          receiptKeys: new Map(),
          checkpointKeys: new Map(),
        }),
        (error: unknown) => {
          assert.ok(error instanceof EvidenceInvalid, `${String(error)} is not EvidenceInvalid`);
          assert.equal(error.message, "record.digest: the record is not this thread's head");
          return true;
        },
      );
    }
  } finally {
    delete replies.getTransition;
    close();
  }
});

test("a watch's reconnects out of range is a RangeError before any stream", { skip: !live }, async () => {
  const { client, close } = await scripted();
  watchedFrom.length = 0;
  try {
    for (const reconnects of [-1, 1.5, Number.NaN, 1_001, Number.POSITIVE_INFINITY]) {
      await assert.rejects(
        client.watch(THREAD, -1, undefined, { reconnects }).next(),
        new RangeError("reconnects must be an integer from 0 to 1000"),
        String(reconnects),
      );
    }
    await assert.rejects(
      client.watch(THREAD, -1, undefined, { reconnects: "3" as unknown as number }).next(),
      new TypeError("reconnects must be a number, not a string"),
    );
    assert.deepEqual(watchedFrom, [], "no stream was opened");
  } finally {
    close();
  }
});
