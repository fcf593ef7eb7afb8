// Against the live service over mTLS: run by tests/integration/test_ts_client.py, which
// starts the service, creates the thread and passes the files in the environment.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { test } from "node:test";
import {
  EvidenceInvalid,
  HandshakeFailed,
  IdentityRevoked,
  loadPublicKeys,
  NodeRunner,
  StaleVersion,
  Unreachable,
  ZtateClient,
  ZtateError,
  type JsonObject,
  type Step,
} from "../src/index.js";
import { readFileSync } from "node:fs";
import { type AddressInfo, connect, createServer, type Socket } from "node:net";
import { Code, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { ApprovalService, Decision, ReviewStatus } from "../src/gen/ztate/v1/approval_pb.js";

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

// --- a certificate the handshake refuses is named, not "server down" (issue 14, item 5) ---

function clientWith(files: { certFile?: string; keyFile?: string; caFile?: string; target?: string; serverName?: string }): ZtateClient {
  return ZtateClient.fromFiles({
    target: files.target ?? env.ZTATE_TARGET!,
    certFile: files.certFile ?? env.ZTATE_CERT!,
    keyFile: files.keyFile ?? env.ZTATE_KEY!,
    caFile: files.caFile ?? env.ZTATE_CA!,
    ...(files.serverName === undefined ? {} : { serverName: files.serverName }),
  });
}

/** What a proposal by `client` throws; the head is checked unchanged (nothing committed). */
async function refusedProposal(client: ZtateClient): Promise<unknown> {
  const before = (await node().getView(THREAD)).version;
  let thrown: unknown;
  await assert.rejects(
    client.propose(THREAD, before, ACTION).then(
      () => undefined,
      (error: unknown) => {
        thrown = error;
        throw error;
      },
    ),
  );
  assert.equal((await node().getView(THREAD)).version, before, "nothing committed");
  return thrown;
}

test("a certificate of another CA: the service refused our certificate", { skip: !live }, async () => {
  const error = await refusedProposal(clientWith({ certFile: env.ZTATE_FOREIGN_CERT!, keyFile: env.ZTATE_FOREIGN_KEY! }));
  assert.ok(error instanceof HandshakeFailed, String(error));
  assert.equal(error.reason, "CERTIFICATE_REFUSED");
  assert.equal(error.code, Code.Unavailable);
  assert.match(error.hint, /^the service refused our certificate \(/);
  assert.match(error.hint, /the client certificate is not issued by the CA file's CA/);
});

test("a CA that did not sign the service: our CA does not trust the server", { skip: !live }, async () => {
  const error = await refusedProposal(clientWith({ caFile: env.ZTATE_FOREIGN_CA! }));
  assert.ok(error instanceof HandshakeFailed, String(error));
  assert.equal(error.reason, "SERVER_NOT_TRUSTED");
  assert.match(error.hint, /^our CA does not trust the service's certificate \(/);
});

test("a server name the service's certificate does not hold", { skip: !live }, async () => {
  const error = await refusedProposal(clientWith({ serverName: "elsewhere.example" }));
  assert.ok(error instanceof HandshakeFailed, String(error));
  assert.equal(error.reason, "SERVER_NAME_MISMATCH");
  assert.match(error.hint, /does not name 'elsewhere.example'/);
});

test("a revoked certificate is named revoked", { skip: !live }, async () => {
  const error = await refusedProposal(clientWith({ certFile: env.ZTATE_REVOKED_CERT!, keyFile: env.ZTATE_REVOKED_KEY! }));
  assert.ok(error instanceof IdentityRevoked, String(error));
  assert.equal(error.reason, "IDENTITY_REVOKED");
  assert.equal(error.code, Code.Unauthenticated);
  assert.match(error.hint, /^the service refused our certificate: it is revoked/);
});

test("an expired certificate is named before any call", { skip: !live }, () => {
  assert.throws(
    () => clientWith({ certFile: env.ZTATE_EXPIRED_CERT!, keyFile: env.ZTATE_EXPIRED_KEY! }),
    (error: unknown) => {
      assert.ok(error instanceof HandshakeFailed);
      assert.equal(error.reason, "CERTIFICATE_EXPIRED");
      assert.match(error.hint, /^the client certificate expired at /);
      return true;
    },
  );
});

test("a key that is not the certificate's is caught before any call", { skip: !live }, () => {
  assert.throws(
    () => clientWith({ keyFile: env.ZTATE_FOREIGN_KEY! }),
    (error: unknown) => error instanceof HandshakeFailed && error.reason === "KEY_MISMATCH",
  );
});

test("a service that is down is unreachable, not a certificate", { skip: !live }, async () => {
  await assert.rejects(clientWith({ target: env.ZTATE_DOWN_TARGET! }).getView(THREAD), (error: unknown) => {
    assert.ok(error instanceof Unreachable, String(error));
    assert.ok(!(error instanceof HandshakeFailed));
    assert.equal(error.reason, "UNREACHABLE");
    assert.equal(error.code, Code.Unavailable);
    assert.match(error.message, new RegExp(`^the service at ${env.ZTATE_DOWN_TARGET} is unreachable`));
    return true;
  });
});

test("a runner throws a service it cannot reach, and records no step", { skip: !live }, async () => {
  const runner = new NodeRunner(clientWith({ target: env.ZTATE_DOWN_TARGET! }), THREAD, () => ACTION, {
    nodeName: "input-parser",
  });
  const view = { threadId: THREAD, version: 0n, state: {}, headDigest: "" };
  await assert.rejects(runner.handle(view), (error: unknown) => error instanceof Unreachable);
  assert.deepEqual(runner.steps, [], "not recorded as refused: the patch was not judged");
});

test("a proxy whose backend is down is not a refused certificate", { skip: !live }, async () => {
  // accepts each connection and closes it at once, as a TCP proxy in front of a dead service
  const proxy = createServer((socket) => socket.destroy());
  await new Promise<void>((listening) => proxy.listen(0, "127.0.0.1", listening));
  const port = (proxy.address() as AddressInfo).port;
  try {
    await assert.rejects(clientWith({ target: `localhost:${port}` }).getView(THREAD), (error: unknown) => {
      assert.ok(!(error instanceof HandshakeFailed), String(error));
      // the transport's own word for a connection broken off (Connect says Aborted)
      assert.ok([Code.Unavailable, Code.Aborted].includes((error as { code: Code }).code), String(error));
      return true;
    });
  } finally {
    proxy.close();
  }
});

// --- createThread: retried and diagnosed like every other call ---

const INITIAL = JSON.parse(env.ZTATE_INITIAL ?? "{}") as JsonObject;

function operator(target: string = env.ZTATE_TARGET!): ZtateClient {
  return clientWith({ target, certFile: env.ZTATE_OPERATOR_CERT!, keyFile: env.ZTATE_OPERATOR_KEY! });
}

function newThreadId(): string {
  return `t-${randomUUID().replace(/-/g, "").slice(0, 16)}`;
}

test("an operator creates a thread; its own repeat answers the genesis; another state is THREAD_EXISTS", { skip: !live }, async () => {
  const client = operator();
  const id = newThreadId();
  const created = await client.createThread(id, INITIAL, "pipeline");
  assert.equal(created.transition.threadId, id);
  assert.equal(created.transition.version, 0n);
  assert.equal(created.transition.parentDigest, "0".repeat(64));
  assert.equal(created.replayed, false);
  const again = await client.createThread(id, INITIAL, "pipeline");
  assert.equal(again.transition.digest, created.transition.digest, "the retry is answered with the genesis");
  assert.equal(again.replayed, true, "and says it replays");
  await assert.rejects(client.createThread(id, { ...INITIAL, raw_text: "another" }, "pipeline"), (error: unknown) => {
    assert.ok(error instanceof ZtateError, String(error));
    assert.equal(error.reason, "THREAD_EXISTS");
    assert.equal(error.code, Code.AlreadyExists);
    return true;
  });
  assert.equal((await client.getRecord(id)).transition?.digest, created.transition.digest, "nothing written");
});

test("createThread with a certificate of another CA: the service refused our certificate, nothing created", { skip: !live }, async () => {
  const id = newThreadId();
  const stranger = clientWith({ certFile: env.ZTATE_FOREIGN_CERT!, keyFile: env.ZTATE_FOREIGN_KEY! });
  await assert.rejects(stranger.createThread(id, INITIAL, "pipeline"), (error: unknown) => {
    assert.ok(error instanceof HandshakeFailed, String(error));
    assert.equal(error.reason, "CERTIFICATE_REFUSED");
    assert.equal(error.code, Code.Unavailable);
    assert.match(error.hint, /^the service refused our certificate \(/);
    return true;
  });
  await assert.rejects(operator().getRecord(id), (error: unknown) => error instanceof ZtateError && error.code === Code.NotFound);
});

test("createThread on a service that is down is unreachable, after its retries", { skip: !live }, async () => {
  await assert.rejects(operator(env.ZTATE_DOWN_TARGET!).createThread(newThreadId(), INITIAL, "pipeline"), (error: unknown) => {
    assert.ok(error instanceof Unreachable, String(error));
    assert.equal(error.reason, "UNREACHABLE");
    return true;
  });
});

/**
 * A TCP proxy to the service at `target` that resets its first connection (the
 * service restarting) and passes the others through; `close` ends it.
 */
async function resettingProxy(target: string): Promise<{ target: string; connections: () => number; close: () => void }> {
  const [host, port] = [target.slice(0, target.lastIndexOf(":")), Number(target.split(":").pop())];
  let connections = 0;
  const open = new Set<Socket>();
  const proxy = createServer((socket) => {
    connections += 1;
    open.add(socket);
    if (connections === 1) {
      socket.resetAndDestroy();
      return;
    }
    const upstream = connect(port, host === "localhost" ? "127.0.0.1" : host);
    open.add(upstream);
    socket.pipe(upstream).pipe(socket);
    socket.on("error", () => upstream.destroy());
    upstream.on("error", () => socket.destroy());
  });
  await new Promise<void>((listening) => proxy.listen(0, "127.0.0.1", listening));
  return {
    target: `localhost:${(proxy.address() as AddressInfo).port}`,
    connections: () => connections,
    close: () => {
      for (const socket of open) socket.destroy();
      proxy.close();
    },
  };
}

test("createThread whose first connection is refused is tried again and creates the thread once", { skip: !live }, async () => {
  const proxy = await resettingProxy(env.ZTATE_TARGET!);
  try {
    const id = newThreadId();
    const created = await operator(proxy.target).createThread(id, INITIAL, "pipeline");
    assert.equal(created.transition.version, 0n);
    assert.ok(proxy.connections() >= 2, "the first connection was refused, a later one created it");
    assert.equal((await operator().getRecord(id)).transition?.digest, created.transition.digest);
  } finally {
    proxy.close();
  }
});

// --- the runner: watch, handle, propose; never acts on its own commit (issue 14, item 6) ---

test("NodeRunner acts once per change of others and never on its own commit", { skip: !live }, async () => {
  const thread = env.ZTATE_RUNNER_THREAD!;
  const planner = clientWith({ certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
  const parser = node();
  const handled: bigint[] = [];
  let committed!: (step: Step) => void;
  let firstStep = new Promise<Step>((resolve) => (committed = resolve));
  const runner = new NodeRunner(
    planner,
    thread,
    (view) => {
      handled.push(view.version);
      const requested = view.state.requested_action as { action: string; order_id: string } | undefined;
      if (requested === undefined) return null;
      // a naive watch-and-act loop would act again on its own commit: the view it gets
      // there still holds this requested_action (a planner cannot read its own plan)
      return { pending_transition: { action: "lookup", order_id: requested.order_id, reason: "looked up" } };
    },
    { nodeName: "planner", stopAfter: 2, onStep: (step) => committed(step) },
  );
  const running = runner.run();
  const one = await parser.propose(thread, 0, { requested_action: { action: "lookup", order_id: "R-1" } });
  assert.ok(one.kind === "committed" && one.transition.version === 1n);
  const first = await firstStep;
  assert.equal(first.status, "committed");
  assert.equal(first.transition?.version, 2n);
  firstStep = new Promise<Step>((resolve) => (committed = resolve));
  const two = await parser.propose(thread, 2, { requested_action: { action: "lookup", order_id: "R-2" } });
  assert.ok(two.kind === "committed" && two.transition.version === 3n);
  const steps = await running;
  assert.deepEqual(
    steps.map((step) => [step.viewVersion, step.status, step.transition?.version]),
    [
      [1n, "committed", 2n],
      [3n, "committed", 4n],
    ],
  );
  assert.deepEqual(handled, [0n, 1n, 3n], "its own commits (2, 4) never reached the handler");
  assert.equal(runner.seen, 4n);
  const head = await planner.getView(thread);
  assert.equal(head.version, 4n, "no extra proposal after its own commits");
});

/** Resolves when the server ends a watch stream of `client` opened now (its lifetime), with nothing new. */
async function oneStreamLifetime(client: ZtateClient, thread: string): Promise<void> {
  const head = (await client.getView(thread)).version;
  for await (const event of client.watch(thread, head, undefined, { resume: false })) {
    throw new Error(`a version came while waiting for the stream's end: ${event.version}`);
  }
}

test("NodeRunner watches again when the server ends its stream at the stream lifetime", { skip: !live }, async () => {
  // a service whose watch streams last 1.5 s (ZTATE_WATCH_MAX_STREAM_SECONDS)
  const target = env.ZTATE_SHORT_TARGET!;
  const thread = env.ZTATE_SHORT_THREAD!;
  const planner = clientWith({ target, certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
  const parser = clientWith({ target });
  let watching!: () => void;
  const sawGenesis = new Promise<void>((resolve) => (watching = resolve));
  let stepped!: (step: Step) => void;
  let nextStep = new Promise<Step>((resolve) => (stepped = resolve));
  const runner = new NodeRunner(
    planner,
    thread,
    (view) => {
      if (view.version === 0n) watching();
      const requested = view.state.requested_action as { order_id: string } | undefined;
      if (requested === undefined) return null;
      return { pending_transition: { action: "lookup", order_id: requested.order_id } };
    },
    { nodeName: "planner", stopAfter: 2, onStep: (step) => stepped(step) },
  );
  let settled = false;
  const running = runner.run().finally(() => (settled = true));
  await sawGenesis; // the runner's stream is open
  for (const [order, base] of [
    ["L-1", 0n],
    ["L-2", 2n],
  ] as const) {
    // a stream opened after the runner's has reached its lifetime: so has the runner's
    await oneStreamLifetime(parser, thread);
    assert.equal(settled, false, "run() ended with the server's stream");
    const proposed = await parser.propose(thread, base, { requested_action: { action: "lookup", order_id: order } });
    assert.ok(proposed.kind === "committed" && proposed.transition.version === base + 1n);
    const step = await nextStep;
    assert.equal(step.status, "committed");
    assert.equal(step.transition?.version, base + 2n);
    nextStep = new Promise<Step>((resolve) => (stepped = resolve));
  }
  const steps = await running;
  assert.deepEqual(
    steps.map((step) => [step.viewVersion, step.status, step.transition?.version]),
    [
      [1n, "committed", 2n],
      [3n, "committed", 4n],
    ],
  );
  assert.equal((await planner.getView(thread)).version, 4n, "nothing proposed twice");
});

test("NodeRunner.run() stops when aborted while the server's streams come and go", { skip: !live }, async () => {
  const target = env.ZTATE_SHORT_TARGET!;
  const planner = clientWith({ target, certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
  const stop = new AbortController();
  let watching!: () => void;
  const sawGenesis = new Promise<void>((resolve) => (watching = resolve));
  const thread = env.ZTATE_SHORT_THREAD!;
  const runner = new NodeRunner(
    planner,
    thread,
    (view) => {
      if (view.version === 0n) watching();
      return null;
    },
    { nodeName: "planner", signal: stop.signal },
  );
  const running = runner.run();
  await sawGenesis;
  await oneStreamLifetime(planner, thread); // the runner is on its second stream by now
  stop.abort();
  assert.deepEqual(await running, [], "aborted: returns the steps, none");
});

test("waitForOutcome asks again past the server's hold of one call", { skip: !live }, async () => {
  // the services of this suite hold one WaitForOutcome call at most 1 s (60 s in production)
  const planner = clientWith({
    target: env.ZTATE_SHORT_TARGET!,
    certFile: env.ZTATE_PLANNER_CERT!,
    keyFile: env.ZTATE_PLANNER_KEY!,
  });
  const thread = env.ZTATE_SHORT_THREAD!;
  const head = (await planner.getView(thread)).version;
  const parked = await planner.propose(thread, head, { target_user_id: "223e4567-e89b-42d3-a456-426614174000" });
  assert.ok(parked.kind === "parked", "acting for another user is parked for a reviewer");
  const began = Date.now();
  const outcome = await planner.waitForOutcome(parked.handle, 3_000);
  const waited = Date.now() - began;
  assert.equal(outcome.status, "pending");
  assert.ok(waited >= 2_500, `answered after ${waited} ms: one call's hold, not the 3 s asked for`);
  assert.ok(waited <= 3_500, `answered after ${waited} ms: past the 3 s asked for`);
  assert.equal((await planner.getView(thread)).version, head, "nothing committed");
});

/** A planner of the short-lived service with a proposal of its own parked there. */
async function parkedOnShortService(): Promise<{ planner: ZtateClient; handle: string; head: bigint }> {
  const planner = clientWith({ target: env.ZTATE_SHORT_TARGET!, certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
  const head = (await planner.getView(env.ZTATE_SHORT_THREAD!)).version;
  const parked = await planner.propose(env.ZTATE_SHORT_THREAD!, head, { target_user_id: "323e4567-e89b-42d3-a456-426614174000" });
  assert.ok(parked.kind === "parked", "acting for another user is parked for a reviewer");
  return { planner, handle: parked.handle, head };
}

test("waitForOutcome refuses a withinMs that is not a finite number, 0 or more, before any call", { skip: !live }, async () => {
  const handle = `${env.ZTATE_SHORT_THREAD!}/k-1`;
  const down = clientWith({ target: env.ZTATE_DOWN_TARGET!, certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
  for (const withinMs of [Number.NaN, Number.POSITIVE_INFINITY, -1]) {
    // on a service that is down: refused as an argument, not found unreachable
    await assert.rejects(down.waitForOutcome(handle, withinMs), (error: unknown) => {
      assert.ok(error instanceof RangeError, String(error));
      assert.equal(error.message, "withinMs must be a finite number of milliseconds, 0 or more");
      return true;
    });
  }
  await assert.rejects(down.waitForOutcome(handle, "5" as unknown as number), (error: unknown) => error instanceof TypeError);
});

test("waitForOutcome on a service that does not answer ends at its deadline, not retried past it", { skip: !live }, async () => {
  // accepts connections and says nothing: a service hung, or a network that drops replies
  const open = new Set<Socket>();
  const silent = createServer((socket) => open.add(socket));
  await new Promise<void>((listening) => silent.listen(0, "127.0.0.1", listening));
  try {
    const planner = clientWith({
      target: `localhost:${(silent.address() as AddressInfo).port}`,
      certFile: env.ZTATE_PLANNER_CERT!,
      keyFile: env.ZTATE_PLANNER_KEY!,
    });
    const began = performance.now();
    await assert.rejects(planner.waitForOutcome(`${env.ZTATE_SHORT_THREAD!}/k-1`, 1_000), (error: unknown) => {
      assert.ok(error instanceof ZtateError, String(error));
      assert.equal(error.code, Code.DeadlineExceeded, "thrown as the Python SDK's wait_for_outcome throws it");
      return true;
    });
    const waited = performance.now() - began;
    assert.ok(waited >= 950, `ended after ${waited} ms, before the 1 s asked for`);
    // a retry overran by 0.7 s (backoff 0.1 + 0.2 + 0.4 s); a busy machine's timers by less
    assert.ok(waited <= 1_500, `ended after ${waited} ms: past the 1 s asked for (retried)`);
  } finally {
    for (const socket of open) socket.destroy();
    silent.close();
  }
});

test("waitForOutcome whose connection is refused throws at once, as the Python SDK: not retried, still parked", { skip: !live }, async () => {
  const { planner, handle, head } = await parkedOnShortService();
  // the diagnosis of the reset (and a retry, were there one) pass through to the
  // service, which would hold the call
  const proxy = await resettingProxy(env.ZTATE_SHORT_TARGET!);
  try {
    const proxied = clientWith({ target: proxy.target, certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
    const began = performance.now();
    await assert.rejects(proxied.waitForOutcome(handle, 3_000), (error: unknown) => {
      assert.ok(error instanceof ZtateError, String(error));
      assert.ok(!(error instanceof HandshakeFailed) && !(error instanceof Unreachable), String(error));
      assert.equal(error.code, Code.Unavailable);
      return true;
    });
    const waited = performance.now() - began;
    assert.ok(waited < 2_000, `thrown after ${waited} ms: retried into the service's hold of 3 s`);
  } finally {
    proxy.close();
  }
  assert.equal((await planner.waitForOutcome(handle, 600)).status, "pending", "still parked");
  assert.equal((await planner.getView(env.ZTATE_SHORT_THREAD!)).version, head, "nothing committed");
});

// --- the check before acting, end to end: approved through the approval service ---

/** Calls `probe` until it returns a value, within `ms`: a condition with a deadline. */
async function until<T>(what: string, ms: number, probe: () => Promise<T | undefined>): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const found = await probe();
    if (found !== undefined) return found;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

test("a risky change approved through the approval service, verified before acting", { skip: !live }, async () => {
  const target = env.ZTATE_PAIR_TARGET!;
  const thread = env.ZTATE_APPROVAL_THREAD!;
  const planner = clientWith({ target, certFile: env.ZTATE_PLANNER_CERT!, keyFile: env.ZTATE_PLANNER_KEY! });
  const writer = clientWith({ target, certFile: env.ZTATE_WRITER_CERT!, keyFile: env.ZTATE_WRITER_KEY! });
  const NEW_USER = "9b2f3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d";

  // the planner changes the target user: the policy's risk rule parks it
  const parked = await planner.propose(thread, 0, { target_user_id: NEW_USER });
  assert.equal(parked.kind, "parked");
  assert.ok(parked.kind === "parked");

  // a reviewer approves it on the approval service, over its own mTLS identity
  const reviewer = createClient(
    ApprovalService,
    createGrpcTransport({
      baseUrl: `https://${env.ZTATE_APPROVAL_SERVICE!}`,
      nodeOptions: {
        cert: readFileSync(env.ZTATE_REVIEWER_CERT!),
        key: readFileSync(env.ZTATE_REVIEWER_KEY!),
        ca: readFileSync(env.ZTATE_CA!),
      },
    }),
  );
  const review = await until("the review reaches the approval service", 20_000, async () => {
    const { reviews } = await reviewer.listReviews({ threadId: thread, status: ReviewStatus.OPEN });
    return reviews[0];
  });
  await reviewer.decide({ digest: review.digest, decision: Decision.APPROVE });
  const outcome = await planner.waitForOutcome(parked.handle, 30_000);
  assert.equal(outcome.status, "committed");
  assert.equal(outcome.transition?.version, 1n);

  // the privileged worker: its view, then the head's checkpoint, then the check
  const head = await writer.getView(thread);
  assert.equal(head.version, 1n);
  assert.match(head.headDigest, /^[0-9a-f]{64}$/, "a read_records node is told the digest");
  await until("the head is checkpointed", 20_000, async () => {
    const signed = await writer.getCheckpoint(thread);
    return signed !== undefined && /"version":1[,}]/.test(new TextDecoder().decode(signed.checkpointJson)) ? signed : undefined;
  });
  const keys = {
    receiptKeys: loadPublicKeys(env.ZTATE_RECEIPT_KEYS!),
    checkpointKeys: loadPublicKeys(env.ZTATE_CHECKPOINT_KEYS!),
  };
  const verified = await writer.verifyHeadBeforeActing({
    threadId: thread,
    version: head.version,
    headDigest: head.headDigest,
    actingOn: { target_user_id: NEW_USER },
    ...keys,
  });
  assert.equal(verified.version, 1n);
  assert.equal(verified.digest, head.headDigest);
  assert.equal(verified.receipt.transition_digest, review.digest, "the receipt binds the reviewed transition");
  assert.equal(verified.receipt.decision, "approve");
  assert.equal(verified.checkpoint.version, 1);

  // and what it must refuse: a value the approval did not set, keys it does not trust
  await assert.rejects(
    writer.verifyHeadBeforeActing({ threadId: thread, version: 1n, headDigest: head.headDigest, actingOn: { target_user_id: USER_ELSE }, ...keys }),
    (error: unknown) => error instanceof EvidenceInvalid && error.check === "record.patch",
  );
  await assert.rejects(
    writer.verifyHeadBeforeActing({
      threadId: thread,
      version: 1n,
      headDigest: head.headDigest,
      actingOn: { target_user_id: NEW_USER },
      receiptKeys: keys.checkpointKeys,
      checkpointKeys: keys.checkpointKeys,
    }),
    (error: unknown) => error instanceof EvidenceInvalid && error.check.startsWith("receipt."),
  );
});
const USER_ELSE = "00000000-0000-4000-8000-000000000000";
