/**
 * The numeric options of the client and the runner, checked when they are given: a
 * NaN, an infinity, a negative or fractional count would make a call retry for ever,
 * a timer fire at once (Node runs a delay above 2^31-1 ms after 1 ms) or a gRPC
 * deadline header malformed ("1.5m"). The error names the option and the range, never
 * the value given (it may be anything a configuration file held).
 */

/** The longest gRPC deadline: its header holds at most 8 digits (ms). */
export const MAX_TIMEOUT_MS = 99_999_999;
/** The longest delay a Node timer keeps (longer ones fire after 1 ms). */
export const MAX_TIMER_MS = 2 ** 31 - 1;
/** Bounds of the retry options: 20 retries from 60 s already wait for years. */
export const MAX_RETRIES = 20;
export const MAX_BACKOFF_MS = 60_000;

/**
 * `value`, when it is an integer from `min` to `max`. Otherwise a TypeError (not a
 * number) or a RangeError naming `name` and the range.
 */
export function checkInteger(name: string, value: unknown, min: number, max: number): number {
  if (typeof value !== "number") {
    throw new TypeError(`${name} must be a number, not a ${typeof value}`);
  }
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new RangeError(`${name} must be an integer from ${min} to ${max}`);
  }
  return value;
}

/** `value`, when it is a finite number of milliseconds, 0 or more. */
export function checkDuration(name: string, value: unknown): number {
  if (typeof value !== "number") {
    throw new TypeError(`${name} must be a number, not a ${typeof value}`);
  }
  if (!Number.isFinite(value) || value < 0) {
    throw new RangeError(`${name} must be a finite number of milliseconds, 0 or more`);
  }
  return value;
}
