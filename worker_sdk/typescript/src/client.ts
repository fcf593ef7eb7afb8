/** The client a worker uses: view, propose and watch over gRPC with mutual TLS. */
import { randomUUID, X509Certificate, createPrivateKey, type KeyObject } from "node:crypto";
import { setTimeout as delay } from "node:timers/promises";
import { connect as tlsConnect } from "node:tls";
import { create } from "@bufbuild/protobuf";
import { Code, createClient, type Client } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { decodeError, HandshakeFailed, Unreachable, ZtateError } from "./errors.js";
import { MAX_CA_BUNDLE_BYTES, MAX_PEM_FILE_BYTES, readBounded } from "./files.js";
import { checkDuration, checkInteger, MAX_BACKOFF_MS, MAX_RETRIES, MAX_TIMEOUT_MS, MAX_TIMER_MS } from "./options.js";
import {
  canonicalize,
  checkCheckpointBinds,
  checkReceiptBinds,
  EvidenceInvalid,
  parseRecord,
  sha256Hex,
  verifyCheckpoint,
  verifyReceipt,
  type Json,
  type JsonObject,
  type PublicKeys,
} from "./evidence.js";
import {
  CreateThreadRequestSchema,
  GetTransitionRequestSchema,
  Outcome as OutcomeKind,
  TransitionService,
  type GetTransitionResponse,
  type SignedCheckpoint,
  type Transition,
  type WaitForOutcomeResponse,
} from "./gen/ztate/v1/transition_pb.js";

const decoder = new TextDecoder("utf-8", { fatal: true });
const encoder = new TextEncoder();

/** Where the service is and which files prove who this worker is. */
export interface ClientFiles {
  /** host:port of the transition service. */
  target: string;
  /** PEM client certificate (its SPIFFE ID is the worker's identity). */
  certFile: string;
  /** PEM private key of that certificate. */
  keyFile: string;
  /** PEM CA certificate that signed the service's certificate. */
  caFile: string;
  /** The name the service's certificate must hold, when not the target's host. */
  serverName?: string;
  /** Default deadline of each unary call, in ms (10 s): an integer from 1 to 99 999 999. */
  timeoutMs?: number;
  /**
   * How often a call that fails in transport (UNAVAILABLE, DEADLINE_EXCEEDED) is
   * tried again (3; an integer from 0 to 20), waiting `backoffMs` (100; an integer
   * from 0 to 60 000), then twice that, and so on. A certificate the handshake refuses
   * is not retried: the same files fail the same way. `fromFiles` throws a TypeError
   * or RangeError naming an option out of its range.
   */
  retries?: number;
  backoffMs?: number;
}

/** The caller's projection of a thread's head. */
export interface View {
  threadId: string;
  /** The head version (int64: a bigint). Propose against it. */
  version: bigint;
  /** The keys the caller may read. */
  state: JsonObject;
  /** The head record's digest; "" for a node not marked read_records. */
  headDigest: string;
}

/** A created thread: its genesis. */
export interface Created {
  /** The genesis transition: version 0, parent digest 64 zeros. */
  transition: Transition;
  /** True when this repeats its caller's creation of the thread (same state and policy): nothing was written. */
  replayed: boolean;
}

/** A committed proposal. */
export interface Committed {
  kind: "committed";
  transition: Transition;
  /** True when this replays an earlier request with the same idempotency key. */
  replayed: boolean;
}

/** A proposal parked for a human decision. */
export interface Parked {
  kind: "parked";
  /** What WaitForOutcome takes: "<thread_id>/<idempotency_key>". */
  handle: string;
  /** The transition digest; "" for a node not marked read_records. */
  digest: string;
  baseVersion: bigint;
}

/** One version of a thread, as the caller may see it. */
export interface WatchEvent {
  threadId: string;
  version: bigint;
  /** The state at that version (projected); null when retention pruned it. */
  state: JsonObject | null;
  /** The record digest; "" for a node not marked read_records. */
  digest: string;
}

/**
 * What became of a parked proposal: "pending", "committed", "rejected", "expired",
 * "stale" or "refused" (approved, but the policy in force no longer allowed it:
 * `reason` says why); `transition` once committed.
 */
export interface Outcome {
  status: string;
  transition?: Transition;
  reason?: string;
}

/** What `verifyHeadBeforeActing` proved. */
export interface VerifiedHead {
  threadId: string;
  version: bigint;
  digest: string;
  record: JsonObject;
  receipt: JsonObject;
  checkpoint: JsonObject;
}

/** A HandshakeFailed this client names (`reason`) about our own files, before any call. */
function ownFiles(reason: string, hint: string): HandshakeFailed {
  return new HandshakeFailed(reason, hint, Code.Unavailable);
}

const PEM_CERTIFICATE = /-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----/g;
const PEM_KEY = /-----BEGIN [A-Z ]*PRIVATE KEY-----/;
// PKCS #8 encrypted, or the traditional (OpenSSL) form with a Proc-Type header
const ENCRYPTED_KEY = /-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type:\s*4,\s*ENCRYPTED/;

/** The certificates of a PEM file, or null when it holds none or one that does not parse. */
function pemCertificates(pems: Buffer): X509Certificate[] | null {
  const blocks = pems.toString("latin1").match(PEM_CERTIFICATE) ?? [];
  if (blocks.length === 0) return null;
  try {
    return blocks.map((block) => new X509Certificate(block));
  } catch {
    return null;
  }
}

/**
 * Catches what the handshake can only refuse before a call is made, with a message
 * that says so (instead of UNAVAILABLE): a file that is not usable (not PEM, a key
 * encrypted with a password, a key of an algorithm or curve Node cannot read), a key
 * that is not the certificate's, or a certificate outside its validity period. The
 * reasons and hints are the Python SDK's (`own_certificate`): each names the file and
 * why, never its content, and Node's error is not kept as the cause (its message may
 * quote the file).
 */
function checkOwnCertificate(cert: Buffer, key: Buffer, ca: Buffer): void {
  let privateKey: KeyObject;
  try {
    privateKey = createPrivateKey(key);
  } catch {
    if (ENCRYPTED_KEY.test(key.toString("latin1"))) {
      throw ownFiles("KEY_UNUSABLE", "the key file is encrypted with a password: ztate reads private keys without one");
    }
    if (PEM_KEY.test(key.toString("latin1"))) {
      throw ownFiles("KEY_UNUSABLE", "the key file is a private key of an unsupported algorithm or curve, or damaged");
    }
    throw ownFiles("KEY_UNUSABLE", "the key file is not a PEM private key");
  }
  const x509 = pemCertificates(cert)?.[0];
  if (x509 === undefined) throw ownFiles("CERTIFICATE_UNUSABLE", "the certificate file is not a PEM certificate");
  let matching: boolean;
  try {
    matching = x509.checkPrivateKey(privateKey);
  } catch {
    throw ownFiles("CERTIFICATE_UNUSABLE", "the certificate file is a certificate for a key of an unsupported algorithm or curve");
  }
  if (pemCertificates(ca) === null) throw ownFiles("CA_UNUSABLE", "the CA file is not a PEM certificate bundle");
  if (!matching) throw ownFiles("KEY_MISMATCH", "the key file is not the private key of the certificate file");
  const now = Date.now();
  if (now >= Date.parse(x509.validTo)) {
    throw ownFiles(
      "CERTIFICATE_EXPIRED",
      `the client certificate expired at ${new Date(x509.validTo).toISOString()}: the service refuses it in the TLS handshake; renew it (ztate ca renew)`,
    );
  }
  if (now < Date.parse(x509.validFrom)) {
    throw ownFiles(
      "CERTIFICATE_NOT_YET_VALID",
      `the client certificate is valid only from ${new Date(x509.validFrom).toISOString()} (is this machine's clock right?): the service refuses it until then`,
    );
  }
}

/** Whether a certificate of the CA file signed the client certificate (both checked by `checkOwnCertificate`). */
function issuedByCa(cert: Buffer, ca: Buffer): boolean {
  const mine = new X509Certificate(cert);
  return (pemCertificates(ca) ?? []).some((authority) => {
    try {
      return mine.checkIssued(authority) && mine.verify(authority.publicKey);
    } catch {
      return false; // a CA certificate whose key Node cannot use signed nothing it can check
    }
  });
}

// The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server that accepted the
// client certificate answers with its own SETTINGS.
const H2_PREFACE = Buffer.concat([
  Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
  Buffer.from([0, 0, 0, 4, 0, 0, 0, 0, 0]),
]);
// Node's codes for a server certificate this client's CA does not verify.
const UNTRUSTED = new Set([
  "UNABLE_TO_VERIFY_LEAF_SIGNATURE",
  "UNABLE_TO_GET_ISSUER_CERT",
  "UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
  "SELF_SIGNED_CERT_IN_CHAIN",
  "DEPTH_ZERO_SELF_SIGNED_CERT",
  "CERT_SIGNATURE_FAILURE",
  "CERT_UNTRUSTED",
  "CERT_HAS_EXPIRED",
  "CERT_NOT_YET_VALID",
]);
/** waitForOutcome asks again after a "pending" answer while more than this is left (the Python SDK's ASK_AGAIN_SECONDS). */
const ASK_AGAIN_MS = 500;
/** The codes of a call that failed in transport and is tried again (the Python SDK's RETRYABLE). */
const RETRYABLE = new Set([Code.Unavailable, Code.DeadlineExceeded]);
/**
 * How connect-node reports a connection or stream that broke under a server stream
 * (the session destroyed: CANCELED; a reset socket: ABORTED; a GOAWAY with an error:
 * INTERNAL), where Python's gRPC says UNAVAILABLE: a watch resumes after them when the
 * service sent no ztate reason.
 */
const STREAM_BREAKS = new Set([Code.Canceled, Code.Aborted, Code.Internal, Code.Unknown]);
/** A watch stream that ended normally after this long served its purpose (the Python SDK's NORMAL_END_SECONDS). */
const NORMAL_END_MS = 1_000;
/** Failed or empty streams in a row before `watch` throws (the Python SDK's `reconnects`). */
const RECONNECTS = 10;
const MAX_RECONNECTS = 1_000;
/** The longest wait before a watch opens its next stream after a failure. */
const MAX_REWATCH_WAIT_MS = 5_000;

/** How `watch` resumes (see `ZtateClient.watch`). */
export interface WatchOptions {
  /** Failed or empty streams in a row before `watch` throws (10; an integer from 0 to 1 000). */
  reconnects?: number;
  /** false: watch one stream, ending with it (true). */
  resume?: boolean;
}
const UNREACHABLE = new Set(["ECONNREFUSED", "ENOTFOUND", "EHOSTUNREACH", "ENETUNREACH", "EAI_AGAIN", "ETIMEDOUT"]);

type TlsFiles = { cert: Buffer; key: Buffer; ca: Buffer };

/**
 * What one TLS connection of our own says about the service, after a call failed in
 * transport without a ztate reason: a typed error naming the likely reason, or null
 * when the handshake and HTTP/2 work (not a certificate problem). With TLS 1.3 the
 * server checks the client certificate after the client's handshake has completed,
 * so its refusal reaches an HTTP/2 client only as a closed stream; this connection
 * sees whether the server closes it (or alerts) instead of answering HTTP/2.
 */
/** Alerts a TLS server sends about the client's certificate (Node's error codes). */
const CERTIFICATE_ALERT = /CERTIFICATE|UNKNOWN_CA|ACCESS_DENIED/;

function diagnose(target: string, tlsFiles: TlsFiles, serverName: string | undefined, code: Code): Promise<ZtateError | null> {
  const colon = target.lastIndexOf(":");
  const host = target.slice(0, colon).replace(/^\[|\]$/g, "");
  const name = serverName ?? host;
  const refused = (detail: string): HandshakeFailed => {
    const why = issuedByCa(tlsFiles.cert, tlsFiles.ca)
      ? "the service does not trust this certificate: its CA is unknown to the service, or the service revoked it at the TLS layer"
      : `the client certificate is not issued by the CA file's CA (its issuer is ${new X509Certificate(tlsFiles.cert).issuer.replace(/\n/g, ", ")}): the service trusts only certificates of its own CA`;
    return new HandshakeFailed("CERTIFICATE_REFUSED", `the service refused our certificate (${detail}): ${why}`, code);
  };
  return new Promise((resolve) => {
    let secure = false;
    const socket = tlsConnect({ host, port: Number(target.slice(colon + 1)), servername: name, ALPNProtocols: ["h2"], ...tlsFiles });
    const done = (verdict: ZtateError | null) => {
      clearTimeout(bound);
      socket.destroy();
      resolve(verdict);
    };
    // a bound on the diagnosis, not a synchronisation: no verdict means "not the certificate"
    const bound = setTimeout(() => done(null), 5_000);
    socket.once("secureConnect", () => {
      secure = true;
      socket.write(H2_PREFACE);
    });
    socket.once("data", () => done(null));
    socket.once("error", (error: Error & { code?: string }) => {
      const errorCode = error.code ?? "";
      if (!secure && UNREACHABLE.has(errorCode)) {
        done(new Unreachable(`the service at ${target} is unreachable (${errorCode}): is it running, and is this its address?`, code, "UNREACHABLE"));
      } else if (errorCode === "ERR_TLS_CERT_ALTNAME_INVALID") {
        done(new HandshakeFailed("SERVER_NAME_MISMATCH", `the service's certificate does not name '${name}': connect with the name in its certificate, or pass serverName`, code));
      } else if (UNTRUSTED.has(errorCode)) {
        done(new HandshakeFailed("SERVER_NOT_TRUSTED", `our CA does not trust the service's certificate (${errorCode}): the CA file is not the CA that signed the service's certificate`, code));
      } else if (secure || CERTIFICATE_ALERT.test(errorCode)) {
        done(refused(errorCode || error.message));
      } else {
        // broken off before the handshake ended (a proxy whose backend is down, a port
        // that is not ours): says nothing about our certificate
        done(null);
      }
    });
    socket.once("close", () => done(secure ? refused("connection closed after the handshake") : null));
  });
}

/**
 * The error for a reply of `call` the protocol does not allow: EvidenceInvalid
 * "reply.form", `fault` saying what is wrong, never with the reply's bytes (they may
 * hold state values). The Python SDK raises ProtocolError (BAD_REPLY) for the same
 * replies, with the same message.
 */
function badReply(call: string, fault: string): EvidenceInvalid {
  return new EvidenceInvalid("reply.form", `the service answered ${call} ${fault}`);
}

/**
 * `value`, a field the protocol says a reply of `call` carries (a sub-message, a oneof);
 * EvidenceInvalid "reply.form" when the reply lacks it. protobuf-es leaves an unset
 * sub-message undefined, which a worker would pass on as the service's answer.
 */
function required<T>(value: T | undefined, call: string, field: string): T {
  if (value === undefined) throw badReply(call, `without the ${field}`);
  return value;
}

/** A committed transition of a reply of `call`: present, with its commit time. */
function committedTransition(transition: Transition | undefined, call: string, field: string = "transition"): Transition {
  const found = required(transition, call, field);
  required(found.committedAt, call, `${field}'s committed_at`);
  return found;
}

/** The outcomes WaitForOutcome may answer: OUTCOME_UNSPECIFIED (0) is never sent. */
const OUTCOMES: ReadonlySet<OutcomeKind> = new Set(
  Object.values(OutcomeKind).filter((value): value is OutcomeKind => typeof value === "number" && value !== OutcomeKind.UNSPECIFIED),
);

/**
 * The JSON object `field` of a reply of `call` carries (a state); EvidenceInvalid
 * "reply.form" when it is empty, not UTF-8 JSON, or JSON of another kind. Not
 * JSON.parse's SyntaxError: its message quotes the text, which may hold state values.
 */
function parseObject(bytes: Uint8Array, call: string, field: string): JsonObject {
  if (bytes.length === 0) throw badReply(call, `with an empty ${field}`);
  let parsed: unknown;
  try {
    parsed = JSON.parse(decoder.decode(bytes));
  } catch {
    throw badReply(call, `with a ${field} that is not JSON`);
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw badReply(call, `with a ${field} that is not a JSON object`);
  }
  return parsed as JsonObject;
}

/** A ztate client for one worker identity. Close it when done. */
export class ZtateClient {
  readonly #client: Client<typeof TransitionService>;
  readonly #timeoutMs: number;
  readonly #target: string;
  readonly #tls: TlsFiles;
  readonly #serverName: string | undefined;
  readonly #retries: number;
  readonly #backoffMs: number;

  private constructor(
    client: Client<typeof TransitionService>,
    files: ClientFiles,
    tls: TlsFiles,
    numbers: { timeoutMs: number; retries: number; backoffMs: number },
  ) {
    this.#client = client;
    this.#timeoutMs = numbers.timeoutMs;
    this.#target = files.target;
    this.#tls = tls;
    this.#serverName = files.serverName;
    this.#retries = numbers.retries;
    this.#backoffMs = numbers.backoffMs;
  }

  /**
   * A client authenticated by the certificate, key and CA files (PEM). Throws a
   * TypeError or RangeError, naming the option, for a `timeoutMs`, `retries` or
   * `backoffMs` that is not an integer of its range (NaN, an infinity, negative,
   * fractional), before reading any file; a RangeError naming a file larger than its
   * kind ever is (1 MiB for a certificate or key, 4 MiB for a CA bundle: a link to
   * /dev/zero is read no further); then `HandshakeFailed` for files the
   * handshake can only refuse (`checkOwnCertificate`: KEY_UNUSABLE, CERTIFICATE_UNUSABLE,
   * CA_UNUSABLE, KEY_MISMATCH, CERTIFICATE_EXPIRED, CERTIFICATE_NOT_YET_VALID).
   */
  static fromFiles(files: ClientFiles): ZtateClient {
    const numbers = {
      timeoutMs: checkInteger("timeoutMs", files.timeoutMs ?? 10_000, 1, MAX_TIMEOUT_MS),
      retries: checkInteger("retries", files.retries ?? 3, 0, MAX_RETRIES),
      backoffMs: checkInteger("backoffMs", files.backoffMs ?? 100, 0, MAX_BACKOFF_MS),
    };
    const cert = readBounded(files.certFile, MAX_PEM_FILE_BYTES, "a certificate");
    const key = readBounded(files.keyFile, MAX_PEM_FILE_BYTES, "a private key");
    const ca = readBounded(files.caFile, MAX_CA_BUNDLE_BYTES, "a CA bundle");
    checkOwnCertificate(cert, key, ca);
    const transport = createGrpcTransport({
      baseUrl: `https://${files.target}`,
      nodeOptions: files.serverName === undefined ? { cert, key, ca } : { cert, key, ca, servername: files.serverName },
      // a reply may hold a state up to the server's limit (docs/api.md, "Limits")
      readMaxBytes: 3 * 64 * 1024 * 1024 + 64 * 1024,
    });
    return new ZtateClient(createClient(TransitionService, transport), files, { cert, key, ca }, numbers);
  }

  /**
   * The error to throw for a failed call. A transport failure without a ztate reason
   * is diagnosed by a TLS connection of our own: a certificate the handshake refuses
   * (HandshakeFailed, with its reason and hint), nothing answering (Unreachable), or
   * neither (the decoded error).
   */
  async #failure(error: unknown): Promise<ZtateError> {
    const decoded = decodeError(error);
    const transport = [Code.Unavailable, Code.Canceled, Code.Internal, Code.Unknown].includes(decoded.code);
    if (!transport || (decoded.reason !== "" && !(decoded instanceof HandshakeFailed))) return decoded;
    // whatever grpc-js made of it (a closed stream is CANCELLED), a refused handshake is UNAVAILABLE
    return (await diagnose(this.#target, this.#tls, this.#serverName, Code.Unavailable)) ?? decoded;
  }

  /**
   * One unary call: a transport failure is diagnosed (#failure) and, unless it is a
   * certificate the handshake refuses, tried again with exponential backoff. Every
   * call is safe to repeat: a proposal keeps its idempotency key, and the service
   * answers its creator's repeated createThread with the genesis.
   */
  async #call<T>(call: () => Promise<T>): Promise<T> {
    for (let attempt = 0; ; attempt += 1) {
      try {
        return await call();
      } catch (error) {
        const failure = await this.#failure(error);
        const transient = RETRYABLE.has(failure.code) && !(failure instanceof HandshakeFailed);
        if (!transient || attempt >= this.#retries) throw failure;
      }
      await new Promise((resolve) => setTimeout(resolve, Math.min(this.#backoffMs * 2 ** attempt, MAX_TIMER_MS)));
    }
  }

  /**
   * Creates a thread bound to `policy` with `initialState` (operator and service
   * identities only; `policy` may be "" when the service loads a single policy).
   * Retried and diagnosed like every other call: the service answers a caller that
   * creates the same thread again with the same state and policy with its genesis,
   * so a retry after a lost reply is not THREAD_EXISTS (another state, policy or
   * caller is).
   */
  async createThread(threadId: string, initialState: { [key: string]: Json }, policy: string = ""): Promise<Created> {
    const request = create(CreateThreadRequestSchema, {
      threadId,
      initialStateJson: encoder.encode(JSON.stringify(initialState)),
      policy,
    });
    const reply = await this.#call(() => this.#client.createThread(request, { timeoutMs: this.#timeoutMs }));
    return { transition: committedTransition(reply.genesis, "CreateThread", "genesis"), replayed: reply.replayed };
  }

  /**
   * The caller's view of the thread's head; EvidenceInvalid "reply.form" for a reply
   * whose state is not a JSON object.
   */
  async getView(threadId: string): Promise<View> {
    const reply = await this.#call(() => this.#client.getView({ threadId }, { timeoutMs: this.#timeoutMs }));
    return {
      threadId: reply.threadId,
      version: reply.version,
      state: parseObject(reply.stateJson, "GetView", "state_json"),
      headDigest: reply.headDigest,
    };
  }

  /**
   * Proposes `patch` on top of `expectedVersion`. Throws ZtateError (StaleVersion when
   * the head moved). Pass the same `idempotencyKey` to retry safely; a fresh one is
   * made otherwise.
   */
  async propose(
    threadId: string,
    expectedVersion: bigint | number,
    patch: { [key: string]: Json },
    idempotencyKey: string = randomUUID(),
  ): Promise<Committed | Parked> {
    const reply = await this.#call(() =>
      this.#client.proposeTransition(
        {
          threadId,
          expectedVersion: BigInt(expectedVersion),
          patchJson: encoder.encode(JSON.stringify(patch)),
          idempotencyKey,
        },
        { timeoutMs: this.#timeoutMs },
      ),
    );
    switch (reply.outcome.case) {
      case "transition":
        return { kind: "committed", transition: committedTransition(reply.outcome.value, "ProposeTransition"), replayed: reply.replayed };
      case "pending":
        return {
          kind: "parked",
          handle: reply.outcome.value.handle,
          digest: reply.outcome.value.digest,
          baseVersion: reply.outcome.value.baseVersion,
        };
      default:
        throw badReply("ProposeTransition", "without the outcome");
    }
  }

  /**
   * Every version newer than `fromVersion` (-1: from genesis), in order, then each one
   * as it commits, until `signal` aborts (the iterator then ends) or the caller breaks
   * out of the loop: the Python SDK's `watch`.
   *
   * The server ends every stream after ZTATE_WATCH_MAX_STREAM_SECONDS (so that access
   * is checked again) or when it stops; a stream also breaks in transport
   * (UNAVAILABLE, DEADLINE_EXCEEDED, or its connection broken under it, which
   * connect-node reports as CANCELED, ABORTED or INTERNAL with no ztate reason). Either way the watch opens a new stream after the
   * last version received, so no version is skipped or repeated: at once after a
   * normal end of a stream that brought a version or lasted a second; after a
   * transport failure, or a stream that ended at once with nothing, after `backoffMs`,
   * twice that, ... (at most 5 s), and after `reconnects` (10; an integer from 0 to
   * 1 000) of those in a row it throws the failure (or an UNAVAILABLE ZtateError "the
   * watch stream keeps ending"). A refusal (another workflow's thread, a stream limit:
   * TOO_MANY_STREAMS) and a certificate the handshake refuses (HandshakeFailed) are
   * thrown at once. `resume: false` watches one stream only: the iterator ends with it.
   *
   * A worker's own commit can arrive here before its propose call returns: decide on
   * versions, not on the order of events. A message the protocol does not allow (a
   * state that is not a JSON object) ends the watch with EvidenceInvalid "reply.form":
   * it is not skipped.
   */
  async *watch(
    threadId: string,
    fromVersion: bigint | number,
    signal?: AbortSignal,
    options: WatchOptions = {},
  ): AsyncGenerator<WatchEvent> {
    const reconnects = checkInteger("reconnects", options.reconnects ?? RECONNECTS, 0, MAX_RECONNECTS);
    let last = BigInt(fromVersion);
    let failures = 0;
    for (;;) {
      const opened = performance.now();
      let received = false;
      let failure: ZtateError | undefined;
      try {
        for await (const reply of this.#client.watchThread(
          { threadId, fromVersion: last },
          signal === undefined ? {} : { signal },
        )) {
          const event: WatchEvent = {
            threadId: reply.threadId,
            version: reply.version,
            state: reply.statePruned ? null : parseObject(reply.stateJson, "WatchThread", "state_json"),
            digest: reply.digest,
          };
          failures = 0;
          received = true;
          last = reply.version;
          yield event;
        }
      } catch (error) {
        if (error instanceof EvidenceInvalid) throw error; // the reply, not the transport
        if (signal?.aborted) return;
        failure = await this.#failure(error);
        // a stream that broke under the call, the service's answer unsent (no reason)
        const broken = failure.reason === "" && STREAM_BREAKS.has(failure.code);
        const transient = (RETRYABLE.has(failure.code) || broken) && !(failure instanceof HandshakeFailed);
        if (!transient || options.resume === false || failures >= reconnects) throw failure;
      }
      if (signal?.aborted || (failure === undefined && options.resume === false)) return;
      // a normal end of a stream that served (its lifetime): resume at once
      if (failure === undefined && (received || performance.now() - opened >= NORMAL_END_MS)) continue;
      failures += 1;
      if (failures > reconnects) {
        throw new ZtateError("the watch stream keeps ending", Code.Unavailable, "UNAVAILABLE");
      }
      try {
        await delay(Math.min(this.#backoffMs * 2 ** (failures - 1), MAX_REWATCH_WAIT_MS), undefined, {
          signal,
        });
      } catch {
        return; // aborted while waiting
      }
    }
  }

  /**
   * Waits until a parked proposal is decided, or `withinMs` pass: `handle` is
   * Parked.handle (or, for operators and read_records nodes, the transition digest).
   * The server answers as soon as the outcome is known; "pending" means the time ran
   * out first. The server holds one call at most 60 s: a longer `withinMs` asks again
   * until it has passed. As the Python SDK's wait_for_outcome: each call gets what is
   * left of `withinMs` as its deadline, and a call that fails is thrown at once
   * (diagnosed like any other), not retried, so that no answer comes after `withinMs`.
   * A `withinMs` that is not a finite number, 0 or more, is a TypeError or RangeError.
   */
  async waitForOutcome(handle: string, withinMs: number = 60_000): Promise<Outcome> {
    checkDuration("withinMs", withinMs);
    const request = handle.includes("/") ? { handle } : { digest: handle };
    // a monotonic clock, as the Python SDK's loop.time(): a clock step changes nothing
    const deadline = performance.now() + withinMs;
    for (;;) {
      let reply: WaitForOutcomeResponse;
      try {
        // what is left of withinMs, in whole ms (the gRPC deadline header's unit), never more
        const left = Math.min(Math.max(Math.floor(deadline - performance.now()), 1), MAX_TIMEOUT_MS);
        reply = await this.#client.waitForOutcome(request, { timeoutMs: left });
      } catch (error) {
        throw await this.#failure(error);
      }
      // the server answers "pending" 0.2 s before a call's deadline, or at its cap
      if (reply.outcome === OutcomeKind.PENDING && deadline - performance.now() > ASK_AGAIN_MS) continue;
      if (!OUTCOMES.has(reply.outcome)) {
        // UNSPECIFIED is never sent; an outcome this client does not know has no status
        throw badReply("WaitForOutcome", `with outcome ${reply.outcome}`);
      }
      const status = (OutcomeKind[reply.outcome] as string).toLowerCase();
      const transition =
        reply.outcome === OutcomeKind.COMMITTED || reply.transition !== undefined
          ? committedTransition(reply.transition, "WaitForOutcome")
          : undefined;
      return {
        status,
        ...(transition === undefined ? {} : { transition }),
        ...(reply.reason === "" ? {} : { reason: reply.reason }),
      };
    }
  }

  /**
   * One ledger record with its receipt and risk rules (read_records nodes and operators);
   * EvidenceInvalid "reply.form" for a reply without the record or its commit time.
   */
  async getRecord(threadId: string, version?: bigint | number): Promise<GetTransitionResponse & { transition: Transition }> {
    const lookup =
      version === undefined
        ? { case: "headOfThread" as const, value: threadId }
        : { case: "threadVersion" as const, value: { threadId, version: BigInt(version) } };
    const reply = await this.#call(() =>
      this.#client.getTransition(create(GetTransitionRequestSchema, { lookup }), { timeoutMs: this.#timeoutMs }),
    );
    return Object.assign(reply, { transition: committedTransition(reply.transition, "GetTransition") });
  }

  /** The newest signed checkpoint of a thread, or undefined before the first. */
  async getCheckpoint(threadId: string): Promise<SignedCheckpoint | undefined> {
    const reply = await this.#call(() => this.#client.getCheckpoint({ threadId }, { timeoutMs: this.#timeoutMs }));
    return reply.checkpoint;
  }

  /**
   * The check a privileged worker makes immediately before it acts, with public keys
   * only (docs/api.md, "The Python SDK", verify_head_before_acting): the head is still
   * the version (and digest) it decided on; its record is well formed and hashes to
   * that digest; the approved patch set each key of `actingOn` to that value; the
   * receipt verifies and binds the record (thread, base version, the transition
   * digest rebuilt from record and risk rules, valid at commit); a signed checkpoint
   * names exactly this head. Throws EvidenceInvalid naming the failed check.
   */
  async verifyHeadBeforeActing(options: {
    threadId: string;
    version: bigint | number;
    headDigest: string;
    actingOn: { [key: string]: Json };
    receiptKeys: PublicKeys;
    checkpointKeys: PublicKeys;
  }): Promise<VerifiedHead> {
    const found = await this.getRecord(options.threadId);
    const transition = found.transition;
    if (transition.version !== BigInt(options.version)) {
      throw new EvidenceInvalid("head.moved", "the head is no longer the version read");
    }
    if (transition.digest !== options.headDigest) {
      throw new EvidenceInvalid("head.digest", "the head is not the record read");
    }
    const record = parseRecord(transition.recordJson);
    if (sha256Hex(transition.recordJson) !== transition.digest) {
      throw new EvidenceInvalid("record.digest", "the record does not hash to its digest");
    }
    // a genuine record of another thread or version, with a checkpoint that names this
    // head's digest, is not this thread's head (as the Python SDK checks)
    if (record.thread_id !== options.threadId || BigInt(record.version as number) !== transition.version) {
      throw new EvidenceInvalid("record.digest", "the record is not this thread's head");
    }
    const patch = record.patch as JsonObject;
    for (const [key, value] of Object.entries(options.actingOn)) {
      if (!Object.hasOwn(patch, key) || canonicalize(patch[key] as Json) !== canonicalize(value)) {
        throw new EvidenceInvalid("record.patch", `the approved patch did not set ${JSON.stringify(key)} to the value acted on`);
      }
    }
    if (found.receipt === undefined) {
      throw new EvidenceInvalid("receipt.missing", "the head was committed without an approval");
    }
    const signedReceipt = {
      json: found.receipt.receiptJson,
      signature: found.receipt.signature,
      keyId: found.receipt.keyId,
    };
    const receipt = verifyReceipt(signedReceipt, options.receiptKeys);
    checkReceiptBinds(receipt, signedReceipt.json, record, found.riskRules);
    const signed = await this.getCheckpoint(options.threadId);
    if (signed === undefined) {
      throw new EvidenceInvalid("checkpoint.missing", "no checkpoint of this thread is signed");
    }
    const checkpoint = verifyCheckpoint(
      { json: signed.checkpointJson, signature: signed.signature, keyId: signed.keyId },
      options.checkpointKeys,
    );
    checkCheckpointBinds(checkpoint, { threadId: options.threadId, version: transition.version, digest: transition.digest });
    return { threadId: options.threadId, version: transition.version, digest: transition.digest, record, receipt, checkpoint };
  }
}
