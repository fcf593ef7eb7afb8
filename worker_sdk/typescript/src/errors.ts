/**
 * Refusals, decoded. ztate puts a google.rpc.Status in the `grpc-status-details-bin`
 * trailer of every refused call, holding a google.rpc.ErrorInfo (reason without its
 * prefix, e.g. "STALE_VERSION") and a ztate.v1.ErrorDetail (keys, current version,
 * limit, rules). Connect decodes the trailer; this module turns it into ZtateError.
 */
import { Code, ConnectError } from "@connectrpc/connect";
import { ErrorInfoSchema } from "./gen/google/rpc/error_details_pb.js";
import { ErrorDetailSchema, ErrorReason } from "./gen/ztate/v1/errors_pb.js";

/** A call ztate refused, or one that never reached it. Switch on `reason`, never on the message. */
export class ZtateError extends Error {
  constructor(
    message: string,
    /** The gRPC status code. */
    readonly code: Code,
    /** The ErrorReason name without its prefix ("STALE_VERSION"); "" when the service sent none. */
    readonly reason: string,
    /** State keys at fault, sorted: the first 32 (`keysTotal` counts all). */
    readonly keys: readonly string[] = [],
    readonly keysTotal: number = 0,
    /** The thread's head version, for STALE_VERSION. */
    readonly currentVersion: bigint = 0n,
    /** The limit exceeded, for PATCH_TOO_LARGE, STATE_TOO_LARGE, TOO_MANY_STREAMS (bytes, streams), QUERY_TOO_COSTLY (ms). */
    readonly limit: bigint = 0n,
    /** Policy rules at fault, for INVARIANT_VIOLATED. */
    readonly rules: readonly string[] = [],
    options?: { cause?: unknown },
  ) {
    super(message, options);
    this.name = "ZtateError";
  }
}

/** STALE_VERSION: the thread moved on; re-read the view (its head is `currentVersion`) and retry. */
export class StaleVersion extends ZtateError {
  override name = "StaleVersion";
}

/**
 * The TLS handshake failed for a certificate reason: the service verifies client
 * certificates in the handshake, which gRPC reports as UNAVAILABLE, like a server that
 * is down (docs/api.md, "Refusals before any RPC"). `reason` (set by this client, not
 * the server) says which, `hint` what to check:
 *
 * - KEY_UNUSABLE, CERTIFICATE_UNUSABLE, CA_UNUSABLE (a file that is not PEM, a key
 *   encrypted with a password, a key of an algorithm or curve Node cannot read),
 *   KEY_MISMATCH, CERTIFICATE_EXPIRED, CERTIFICATE_NOT_YET_VALID: our own files,
 *   checked before any call (`ZtateClient.fromFiles` throws);
 * - CERTIFICATE_REFUSED: the service refused our certificate (another CA, or unknown
 *   to the service);
 * - SERVER_NOT_TRUSTED: our CA file does not verify the service's certificate;
 * - SERVER_NAME_MISMATCH: the service's certificate does not name the host dialed;
 * - HANDSHAKE_FAILED: Node's TLS layer failed with no more precise verdict.
 */
export class HandshakeFailed extends ZtateError {
  override name = "HandshakeFailed";
  constructor(
    reason: string,
    readonly hint: string,
    code: Code,
    options?: { cause?: unknown },
  ) {
    super(hint, code, reason, [], 0, 0n, 0n, [], options);
  }
}

/** Nothing answers at the service's address (reason UNREACHABLE, set by this client). */
export class Unreachable extends ZtateError {
  override name = "Unreachable";
}

/**
 * IDENTITY_REVOKED: the service's revocation list names our certificate or our whole
 * identity; no retry with this certificate succeeds.
 */
export class IdentityRevoked extends ZtateError {
  override name = "IdentityRevoked";
  readonly hint =
    "the service refused our certificate: it is revoked (the service's revocation list " +
    "names its serial or its identity); a revoked certificate needs a new one (ztate ca " +
    "renew), a revoked identity needs an operator";
}

/**
 * CERTIFICATE_EXPIRED: our certificate's validity period ended on a connection opened
 * while it was valid; no retry with this certificate succeeds.
 */
export class CertificateExpired extends ZtateError {
  override name = "CertificateExpired";
  readonly hint =
    "the service refused our certificate: it has expired (or is not valid yet); renew it " +
    "(ztate ca renew, or your PKI's tooling) and connect again with the new files";
}

// What Node's TLS stack says when a handshake fails on a certificate (client or server).
const TLS_FAILURE =
  /alert|certificate|handshake|ssl|tls|self[- ]signed|unable to verify|ERR_TLS|socket disconnected before secure/i;

function messages(error: unknown): string {
  const parts: string[] = [];
  for (let cause = error, depth = 0; cause instanceof Error && depth < 8; depth += 1) {
    parts.push(cause.message, (cause as { code?: string }).code ?? "");
    cause = cause.cause;
  }
  return parts.join(" | ");
}

/** A ZtateError for anything a call threw. */
export function decodeError(error: unknown): ZtateError {
  const connect = ConnectError.from(error);
  const [info] = connect.findDetails(ErrorInfoSchema);
  const [detail] = connect.findDetails(ErrorDetailSchema);
  if (info === undefined && detail === undefined) {
    const text = messages(error);
    if (
      (connect.code === Code.Unavailable || connect.code === Code.Internal || connect.code === Code.Unknown) &&
      TLS_FAILURE.test(text)
    ) {
      return new HandshakeFailed(
        "HANDSHAKE_FAILED",
        `the TLS handshake with the service failed (${connect.rawMessage}): the service ` +
          "refuses a client certificate that is missing, expired, or not signed by its CA, " +
          "and this client refuses a server certificate not signed by the CA it was given. " +
          "Check the cert, key and CA files (ztate certificates are signed by the service's CA).",
        connect.code,
        { cause: error },
      );
    }
    // a connection the service (or a proxy) reset is UNAVAILABLE, as gRPC says it: Connect
    // says Aborted, which it means for a peer that hung up on a call it was serving
    const code = connect.code === Code.Aborted && /(^| )ECONNRESET( |$)/.test(text) ? Code.Unavailable : connect.code;
    return new ZtateError(connect.rawMessage, code, "", [], 0, 0n, 0n, [], { cause: error });
  }
  const reason = info?.reason ?? (detail === undefined ? "" : (ErrorReason[detail.reason] ?? ""));
  const Kind =
    reason === "STALE_VERSION"
      ? StaleVersion
      : reason === "IDENTITY_REVOKED"
        ? IdentityRevoked
        : reason === "CERTIFICATE_EXPIRED"
          ? CertificateExpired
          : ZtateError;
  return new Kind(
    connect.rawMessage,
    connect.code,
    reason,
    detail?.keys ?? [],
    detail?.keysTotal ?? 0,
    detail?.currentVersion ?? 0n,
    detail?.limit ?? 0n,
    detail?.rules ?? [],
    { cause: error },
  );
}
