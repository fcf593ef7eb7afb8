/**
 * A node as a function from its view to a patch, driven by the thread's changes: the
 * TypeScript twin of the Python SDK's NodeRunner (docs/api.md, "TypeScript").
 */
import { randomUUID } from "node:crypto";
import { Code } from "@connectrpc/connect";
import type { Committed, Parked, View, ZtateClient } from "./client.js";
import { StaleVersion, ZtateError } from "./errors.js";
import { checkDuration, checkInteger } from "./options.js";
import type { Json } from "./evidence.js";
import type { Transition } from "./gen/ztate/v1/transition_pb.js";

/** The most times a proposal beaten by another writer is re-run (`attempts`). */
const MAX_RUNNER_ATTEMPTS = 1_000;

/** What a handler returns: the patch to propose, or null/undefined to do nothing. */
export type Patch = { [key: string]: Json };
export type Handler = (view: View) => Patch | null | undefined | Promise<Patch | null | undefined>;

/**
 * What one proposal of the runner became: "committed"; "refused" (`error` says why:
 * nothing was written); or a parked proposal's outcome ("rejected", "expired",
 * "stale", "refused", "pending" when the wait ran out). `transition` is set once
 * committed, `handle` once parked.
 */
export interface Step {
  viewVersion: bigint;
  patch: Patch;
  status: string;
  transition?: Transition;
  handle?: string;
  error?: ZtateError;
}

export interface RunnerOptions {
  /** Names the idempotency keys of this runner's proposals ("node"). */
  nodeName?: string;
  /** Versions newer than this are handled (-1: from genesis). */
  fromVersion?: bigint | number;
  /** Proposals beaten by another writer are re-run on a fresh view this often (5; an integer from 1 to 1 000). */
  attempts?: number;
  /** How long a parked proposal's outcome is waited for, in ms (60 s; finite, 0 or more). */
  approvalWaitMs?: number;
  /** `run` returns after this many proposals (an integer, 1 or more). */
  stopAfter?: number;
  /** Stops `run` (it then returns the steps so far). */
  signal?: AbortSignal;
  onStep?: (step: Step) => void;
  onParked?: (parked: Parked) => void;
}

/**
 * Runs `handler` on every new version of `threadId` the node can see and proposes
 * what it returns.
 *
 * The watch-and-act trap (a node's own commit can reach its watch stream before its
 * propose call returns) is handled by deciding on versions, not on the order of
 * events: versions at or below the last one the node saw or committed are skipped, so
 * the node's own commits never reach its handler and it never acts twice on one
 * change. A proposal beaten by another writer (StaleVersion) is re-run on a fresh view;
 * a parked one is waited for and its outcome recorded; any other refusal is recorded
 * as "refused" and the node carries on. The watch rides out transport failures (its
 * `reconnects`); a certificate the handshake refuses, and failures past them, are
 * thrown.
 */
export class NodeRunner {
  readonly steps: Step[] = [];
  #seen: bigint;
  readonly #options: RunnerOptions;

  constructor(
    readonly client: ZtateClient,
    readonly threadId: string,
    readonly handler: Handler,
    options: RunnerOptions = {},
  ) {
    // a NaN or an infinity here would re-run a proposal for ever, or never propose
    checkInteger("attempts", options.attempts ?? 5, 1, MAX_RUNNER_ATTEMPTS);
    checkDuration("approvalWaitMs", options.approvalWaitMs ?? 60_000);
    if (options.stopAfter !== undefined) checkInteger("stopAfter", options.stopAfter, 1, Number.MAX_SAFE_INTEGER);
    this.#options = options;
    this.#seen = BigInt(options.fromVersion ?? -1);
  }

  /** The newest version this node saw or committed. */
  get seen(): bigint {
    return this.#seen;
  }

  /**
   * Watch the thread and act on it until aborted, or until `stopAfter` proposals. The
   * watch resumes by itself (`ZtateClient.watch`): when the server ends a stream after
   * its maximum lifetime (ZTATE_WATCH_MAX_STREAM_SECONDS) or when it stops, and through
   * transport failures, from the last version received, as the Python runner's does.
   * What the watch throws (a refusal, a certificate the handshake refuses, failures
   * past its reconnects) is thrown.
   */
  async run(): Promise<Step[]> {
    const { stopAfter, signal } = this.#options;
    const stop = new AbortController();
    const abort = () => stop.abort();
    signal?.addEventListener("abort", abort, { once: true });
    if (signal?.aborted) stop.abort();
    try {
      for await (const event of this.client.watch(this.threadId, this.#seen, stop.signal)) {
        if (event.version <= this.#seen) continue; // our own commit, or superseded
        const view: View =
          event.state === null
            ? await this.client.getView(this.threadId)
            : { threadId: event.threadId, version: event.version, state: event.state, headDigest: event.digest };
        await this.handle(view);
        if (stopAfter !== undefined && this.steps.length >= stopAfter) return this.steps;
      }
    } finally {
      signal?.removeEventListener("abort", abort);
      stop.abort();
    }
    return this.steps;
  }

  /** Run the handler on `view` and carry its patch through to an outcome. */
  async handle(view: View): Promise<Step | null> {
    const attempts = this.#options.attempts ?? 5;
    for (let attempt = 0; attempt < attempts; attempt += 1) {
      if (view.version > this.#seen) this.#seen = view.version;
      const patch = await this.handler(view);
      if (patch === null || patch === undefined) return null;
      const key = `${this.#options.nodeName ?? "node"}-${view.version}-${randomUUID().slice(0, 12)}`;
      let outcome: Committed | Parked;
      try {
        outcome = await this.client.propose(this.threadId, view.version, patch, key);
      } catch (error) {
        if (error instanceof StaleVersion && attempt < attempts - 1) {
          view = await this.client.getView(this.threadId);
          continue;
        }
        // a refusal is recorded; a service out of reach (UNAVAILABLE: the database, the
        // network, a refused certificate, all with a reason of their own) is thrown
        if (error instanceof ZtateError && error.reason !== "" && error.code !== Code.Unavailable) {
          return this.#record({ viewVersion: view.version, patch, status: "refused", error });
        }
        throw error;
      }
      if (outcome.kind === "committed") {
        return this.#record({ viewVersion: view.version, patch, status: "committed", transition: outcome.transition });
      }
      this.#options.onParked?.(outcome);
      const decided = await this.client.waitForOutcome(outcome.handle, this.#options.approvalWaitMs ?? 60_000);
      const step = this.#record({
        viewVersion: view.version,
        patch,
        status: decided.status,
        handle: outcome.handle,
        ...(decided.transition === undefined ? {} : { transition: decided.transition }),
      });
      if (decided.status === "stale" && attempt < attempts - 1) {
        view = await this.client.getView(this.threadId);
        continue;
      }
      return step;
    }
    return null;
  }

  #record(step: Step): Step {
    if (step.transition !== undefined && step.transition.version > this.#seen) {
      this.#seen = step.transition.version;
    }
    this.steps.push(step);
    this.#options.onStep?.(step);
    return step;
  }
}
