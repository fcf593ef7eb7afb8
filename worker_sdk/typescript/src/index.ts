/** @ztate/worker: the TypeScript client for ztate agent workers (docs/api.md, "TypeScript"). */
export { ZtateClient } from "./client.js";
export type { ClientFiles, Committed, Created, Outcome, Parked, VerifiedHead, View, WatchEvent, WatchOptions } from "./client.js";
export { NodeRunner } from "./runner.js";
export type { Handler, Patch, RunnerOptions, Step } from "./runner.js";
export {
  CertificateExpired,
  decodeError,
  HandshakeFailed,
  IdentityRevoked,
  StaleVersion,
  Unreachable,
  ZtateError,
} from "./errors.js";
export {
  canonicalize,
  checkCheckpointBinds,
  checkReceiptBinds,
  ed25519PublicKey,
  loadPublicKeys,
  EvidenceInvalid,
  parseRecord,
  sha256Hex,
  transitionDigest,
  verifyCheckpoint,
  verifyReceipt,
} from "./evidence.js";
export type { Json, JsonObject, PublicKeys, Signed } from "./evidence.js";
export * as v1 from "./gen/ztate/v1/transition_pb.js";
export { ErrorReason } from "./gen/ztate/v1/errors_pb.js";
