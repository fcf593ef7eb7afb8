// Reading a file whose content has a natural bound (a certificate, a key, a CA bundle,
// a public keyring): never more than the bound in memory, whatever the file turns out to
// be (a link to /dev/zero, a file that keeps growing, a huge one). The Python SDK's
// `read_bounded` (contract/files.py), with the same bounds.
import { closeSync, openSync, readSync } from "node:fs";

/** A certificate or a private key in PEM: a few kilobytes, a long chain some tens. */
export const MAX_PEM_FILE_BYTES = 1024 * 1024;
/** A CA bundle: every CA trusted during a rotation, or a system bundle. */
export const MAX_CA_BUNDLE_BYTES = 4 * 1024 * 1024;

/**
 * The bytes of `path` (`what` it holds, for the message), at most `limit` of them: a
 * RangeError naming the file when it holds more, read no further. Node's own error
 * when it cannot be opened or read.
 */
export function readBounded(path: string, limit: number, what: string): Buffer {
  const fd = openSync(path, "r");
  try {
    const buffer = Buffer.alloc(limit + 1);
    let size = 0;
    while (size < buffer.length) {
      const read = readSync(fd, buffer, size, buffer.length - size, null);
      if (read === 0) break;
      size += read;
    }
    if (size > limit) {
      throw new RangeError(`${path}: more than ${limit.toLocaleString("en")} bytes, too large for ${what}`);
    }
    return Buffer.from(buffer.subarray(0, size));
  } finally {
    closeSync(fd);
  }
}
