// Replies the protocol does not allow, from a scripted service over mTLS (the service
// certificate of tests/integration/test_ts_client.py's CA, in the environment): a reply
// without a sub-message or oneof it must carry is EvidenceInvalid "reply.form", thrown
// at once and not retried, as the Python SDK's ProtocolError (BAD_REPLY); never a
// result of undefined fields passed on as the service's answer.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createSecureServer, type ServerHttp2Session } from "node:http2";
import { type AddressInfo } from "node:net";
import { test } from "node:test";
import { timestampFromDate } from "@bufbuild/protobuf/wkt";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { EvidenceInvalid, ZtateClient } from "../src/index.js";
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

function answer(call: string): object {
  asked.push(call);
  return replies[call] ?? {};
}

async function scripted(): Promise<{ client: ZtateClient; close: () => void }> {
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
    backoffMs: 1,
  });
  // the client keeps its connection: end it with the server
  return { client, close: () => (server.close(), sessions.forEach((session) => session.destroy())) };
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
