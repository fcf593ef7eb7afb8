// A ztate worker in TypeScript, with nothing of ztate but @ztate/worker and its own
// certificate: it reads its view, proposes a patch, then tries to write a key it may
// not (is_admin) and prints the typed refusal. One JSON object per line.
import { parseArgs } from "node:util";
import { ZtateClient, ZtateError } from "@ztate/worker";

const { values } = parseArgs({
  options: {
    target: { type: "string", default: "localhost:50051" },
    cert: { type: "string" },
    key: { type: "string" },
    ca: { type: "string" },
    thread: { type: "string" },
    patch: { type: "string" },
  },
});
const { target, cert, key, ca, thread, patch } = values;
if (!cert || !key || !ca || !thread || !patch) {
  throw new Error("usage: worker --target HOST:PORT --cert C --key K --ca CA --thread T --patch JSON");
}

const client = ZtateClient.fromFiles({ target: target!, certFile: cert, keyFile: key, caFile: ca });
// int64 versions are bigints: print them as numbers (they stay below 2^53)
const show = (line: object) =>
  console.log(JSON.stringify(line, (_, v) => (typeof v === "bigint" ? Number(v) : v)));

const view = await client.getView(thread);
show({ step: "view", version: view.version, state: view.state });

const outcome = await client.propose(thread, view.version, JSON.parse(patch));
if (outcome.kind === "committed") {
  const t = outcome.transition;
  show({ step: "committed", version: t.version, node_id: t.nodeId, digest: t.digest });
} else {
  show({ step: "parked", handle: outcome.handle });
}

try {
  await client.propose(thread, view.version + 1n, { is_admin: true });
  show({ step: "unexpected", message: "the protected key was accepted" });
} catch (error) {
  if (!(error instanceof ZtateError)) throw error;
  show({ step: "refused", code: error.code, reason: error.reason, keys: error.keys, message: error.message });
}
