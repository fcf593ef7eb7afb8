/**
 * A node as a function from its view to a patch, driven by the thread's changes: the
 * TypeScript twin of the Python SDK's NodeRunner (docs/api.md, "TypeScript").
 */
import { randomUUID } from "node:crypto";
import { setTimeout as delay } from "node:timers/promises";
import { Code } from "@connectrpc/connect";
import type { Committed, Parked, View, ZtateClient } from "./client.js";
import { StaleVersion, ZtateError } from "./errors.js";
import { checkDuration, checkInteger } from "./options.js";
import type { Json } from "./evidence.js";
import type { Transition } from "./gen/ztate/v1/transition_pb.js";

/** A watch stream that ended normally after this long served its purpose (the Python SDK's NORMAL_END_SECONDS). */
const NORMAL_END_MS = 1_000;
/** Streams that end at once with nothing, in a row, before `run` gives up (the Python SDK's `reconnects`). */
const REWATCHES = 10;
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
 * as "refused" and the node carries on. Transport failures (UNAVAILABLE, a refused
 * certificate) are thrown.
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
   * server ends every watch stream after its maximum lifetime
   * (ZTATE_WATCH_MAX_STREAM_SECONDS), or when it stops: the runner then watches again
   * from the last version it saw, as the Python runner does. A stream that ends at
   * once with nothing counts as a failure: after REWATCHES of them in a row (waiting
   * 0.1 s, 0.2 s, ... up to 5 s between them) an UNAVAILABLE ZtateError is thrown. A
   * transport failure or a refusal is thrown at once.
   */
  async run(): Promise<Step[]> {
    const { stopAfter, signal } = this.#options;
    const stop = new AbortController();
    const abort = () => stop.abort();
    signal?.addEventListener("abort", abort, { once: true });
    if (signal?.aborted) stop.abort();
    try {
      let quickEnds = 0;
      while (!stop.signal.aborted) {
        const opened = Date.now();
        let received = false;
        for await (const event of this.client.watch(this.threadId, this.#seen, stop.signal)) {
          received = true;
          if (event.version <= this.#seen) continue; // our own commit, or superseded
          const view: View =
            event.state === null
              ? await this.client.getView(this.threadId)
              : { threadId: event.threadId, version: event.version, state: event.state, headDigest: event.digest };
          await this.handle(view);
          if (stopAfter !== undefined && this.steps.length >= stopAfter) return this.steps;
        }
        if (stop.signal.aborted) break;
        // the server ended the stream: one that served is resumed at once
        if (received || Date.now() - opened >= NORMAL_END_MS) {
          quickEnds = 0;
          continue;
        }
        quickEnds += 1;
        if (quickEnds > REWATCHES) {
          throw new ZtateError("the watch stream keeps ending", Code.Unavailable, "UNAVAILABLE");
        }
        try {
          await delay(Math.min(100 * 2 ** (quickEnds - 1), 5_000), undefined, { signal: stop.signal });
        } catch {
          break; // aborted while waiting
        }
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
