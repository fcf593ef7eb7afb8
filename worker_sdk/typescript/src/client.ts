/** The client a worker uses: view, propose and watch over gRPC with mutual TLS. */
import { randomUUID, X509Certificate, createPrivateKey } from "node:crypto";
import { readFileSync } from "node:fs";
import { connect as tlsConnect } from "node:tls";
import { create } from "@bufbuild/protobuf";
import { Code, createClient, type Client } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { decodeError, HandshakeFailed, type ZtateError } from "./errors.js";
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
  GetTransitionRequestSchema,
  TransitionService,
  type GetTransitionResponse,
  type SignedCheckpoint,
  type Transition,
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
  /** Default deadline of each unary call, in ms (10 s). */
  timeoutMs?: number;
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

/** What `verifyHeadBeforeActing` proved. */
export interface VerifiedHead {
  threadId: string;
  version: bigint;
  digest: string;
  record: JsonObject;
  receipt: JsonObject;
  checkpoint: JsonObject;
}

/**
 * Catches what the handshake would refuse before a call is made, with a message that
 * says so (instead of UNAVAILABLE): a key that is not the certificate's, or a
 * certificate outside its validity period.
 */
function checkOwnCertificate(cert: Buffer, key: Buffer): void {
  const x509 = new X509Certificate(cert);
  if (!x509.checkPrivateKey(createPrivateKey(key))) {
    throw new HandshakeFailed("the key file is not the private key of the certificate file", Code.Unauthenticated);
  }
  const now = Date.now();
  if (now < Date.parse(x509.validFrom) || now >= Date.parse(x509.validTo)) {
    throw new HandshakeFailed(
      `the client certificate is valid from ${x509.validFrom} to ${x509.validTo}: the service refuses it in the TLS handshake`,
      Code.Unauthenticated,
    );
  }
}

// The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server that accepted the
// client certificate answers with its own SETTINGS.
const H2_PREFACE = Buffer.concat([
  Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
  Buffer.from([0, 0, 0, 4, 0, 0, 0, 0, 0]),
]);

/**
 * Why the service's TLS refuses this client, or null if it accepts it. With TLS 1.3 the
 * server checks the client certificate after the client's handshake has completed, so
 * its refusal reaches an HTTP/2 client only as a closed stream; a connection of its
 * own shows whether the server closes it (or alerts) instead of answering HTTP/2.
 */
function handshakeVerdict(target: string, tlsFiles: { cert: Buffer; key: Buffer; ca: Buffer }): Promise<string | null> {
  const colon = target.lastIndexOf(":");
  const host = target.slice(0, colon).replace(/^\[|\]$/g, "");
  return new Promise((resolve) => {
    const socket = tlsConnect({ host, port: Number(target.slice(colon + 1)), servername: host, ALPNProtocols: ["h2"], ...tlsFiles });
    const done = (verdict: string | null) => {
      clearTimeout(bound);
      socket.destroy();
      resolve(verdict);
    };
    // a bound on the diagnosis, not a synchronisation: no verdict means "not the certificate"
    const bound = setTimeout(() => done(null), 5_000);
    socket.once("secureConnect", () => socket.write(H2_PREFACE));
    socket.once("data", () => done(null));
    socket.once("error", (error) => done(error.message));
    socket.once("close", () => done("the service closed the connection after the TLS handshake"));
  });
}

function parseState(bytes: Uint8Array): JsonObject {
  return JSON.parse(decoder.decode(bytes)) as JsonObject;
}

/** A ztate client for one worker identity. Close it when done. */
export class ZtateClient {
  readonly #client: Client<typeof TransitionService>;
  readonly #timeoutMs: number;
  readonly #target: string;
  readonly #tls: { cert: Buffer; key: Buffer; ca: Buffer };

  private constructor(
    client: Client<typeof TransitionService>,
    timeoutMs: number,
    target: string,
    tls: { cert: Buffer; key: Buffer; ca: Buffer },
  ) {
    this.#client = client;
    this.#timeoutMs = timeoutMs;
    this.#target = target;
    this.#tls = tls;
  }

  /** A client authenticated by the certificate, key and CA files (PEM). */
  static fromFiles(files: ClientFiles): ZtateClient {
    const cert = readFileSync(files.certFile);
    const key = readFileSync(files.keyFile);
    const ca = readFileSync(files.caFile);
    checkOwnCertificate(cert, key);
    const transport = createGrpcTransport({
      baseUrl: `https://${files.target}`,
      nodeOptions: { cert, key, ca },
      // a reply may hold a state up to the server's limit (docs/api.md, "Limits")
      readMaxBytes: 72 * 1024 * 1024 + 64 * 1024,
    });
    return new ZtateClient(createClient(TransitionService, transport), files.timeoutMs ?? 10_000, files.target, {
      cert,
      key,
      ca,
    });
  }

  /** The error to throw for a failed call: with a handshake hint when the TLS layer refused us. */
  async #failure(error: unknown): Promise<ZtateError> {
    const decoded = decodeError(error);
    const transport = [Code.Unavailable, Code.Canceled, Code.Internal, Code.Unknown].includes(decoded.code);
    if (decoded instanceof HandshakeFailed || decoded.reason !== "" || !transport) return decoded;
    const verdict = await handshakeVerdict(this.#target, this.#tls);
    if (verdict === null) return decoded;
    return new HandshakeFailed(
      `the service refused this client's TLS connection (${verdict}): it refuses a client ` +
        "certificate that is missing, expired, revoked at the TLS layer, or not signed by its CA. " +
        "Check the cert and key files (ztate certificates are signed by the service's CA).",
      decoded.code,
      { cause: error },
    );
  }

  async #call<T>(call: () => Promise<T>): Promise<T> {
    try {
      return await call();
    } catch (error) {
      throw await this.#failure(error);
    }
  }

  /** The caller's view of the thread's head. */
  async getView(threadId: string): Promise<View> {
    const reply = await this.#call(() => this.#client.getView({ threadId }, { timeoutMs: this.#timeoutMs }));
    return {
      threadId: reply.threadId,
      version: reply.version,
      state: parseState(reply.stateJson),
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
        return { kind: "committed", transition: reply.outcome.value, replayed: reply.replayed };
      case "pending":
        return {
          kind: "parked",
          handle: reply.outcome.value.handle,
          digest: reply.outcome.value.digest,
          baseVersion: reply.outcome.value.baseVersion,
        };
      default:
        throw new EvidenceInvalid("reply.form", "the service sent neither a transition nor a pending one");
    }
  }

  /**
   * Every version newer than `fromVersion` (-1: from genesis), then each one as it
   * commits, until `signal` aborts or the server ends the stream (after
   * ZTATE_WATCH_MAX_STREAM_SECONDS: call again from the last version received).
   * A worker's own commit can arrive here before its propose call returns: decide on
   * versions, not on the order of events.
   */
  async *watch(threadId: string, fromVersion: bigint | number, signal?: AbortSignal): AsyncGenerator<WatchEvent> {
    try {
      for await (const reply of this.#client.watchThread(
        { threadId, fromVersion: BigInt(fromVersion) },
        signal === undefined ? {} : { signal },
      )) {
        yield {
          threadId: reply.threadId,
          version: reply.version,
          state: reply.statePruned ? null : parseState(reply.stateJson),
          digest: reply.digest,
        };
      }
    } catch (error) {
      if (signal?.aborted) return;
      throw await this.#failure(error);
    }
  }

  /** One ledger record with its receipt and risk rules (read_records nodes and operators). */
  async getRecord(threadId: string, version?: bigint | number): Promise<GetTransitionResponse> {
    const lookup =
      version === undefined
        ? { case: "headOfThread" as const, value: threadId }
        : { case: "threadVersion" as const, value: { threadId, version: BigInt(version) } };
    return this.#call(() =>
      this.#client.getTransition(create(GetTransitionRequestSchema, { lookup }), { timeoutMs: this.#timeoutMs }),
    );
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
    if (transition === undefined || transition.version !== BigInt(options.version)) {
      throw new EvidenceInvalid("head.moved", "the head is no longer the version read");
    }
    if (transition.digest !== options.headDigest) {
      throw new EvidenceInvalid("head.digest", "the head is not the record read");
    }
    const record = parseRecord(transition.recordJson);
    if (sha256Hex(transition.recordJson) !== transition.digest) {
      throw new EvidenceInvalid("record.digest", "the record does not hash to its digest");
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
