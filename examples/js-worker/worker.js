#!/usr/bin/env node
// A ztate worker in JavaScript on @grpc/grpc-js. It needs nothing of ztate but the
// .proto files in proto/ztate/v1 and its own mTLS certificate: it authenticates,
// reads its view, proposes a patch, and shows a refused write.
//
//   node worker.js --target localhost:7443 --cert node.crt --key node.key --ca ca.crt \
//                  --thread demo --patch '{"requested_action": {"action": "none"}}'
//
// It prints one JSON object per step on stdout.
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function args(argv) {
  const out = {};
  for (let i = 2; i < argv.length; i += 2) out[argv[i].replace(/^--/, "")] = argv[i + 1];
  for (const name of ["target", "cert", "key", "ca", "thread", "patch"]) {
    if (!out[name]) throw new Error(`--${name} is required`);
  }
  return out;
}

function client(opts) {
  const protoDir = opts.proto || path.resolve(__dirname, "..", "..", "proto");
  const definition = protoLoader.loadSync(path.join(protoDir, "ztate/v1/transition.proto"), {
    includeDirs: [protoDir],
    keepCase: true,
    longs: Number,
    defaults: true,
  });
  const ztate = grpc.loadPackageDefinition(definition).ztate.v1;
  const credentials = grpc.credentials.createSsl(
    fs.readFileSync(opts.ca),
    fs.readFileSync(opts.key),
    fs.readFileSync(opts.cert),
  );
  return new ztate.TransitionService(opts.target, credentials);
}

function call(stub, method, request) {
  return new Promise((resolve, reject) => {
    stub[method](request, { deadline: Date.now() + 10000 }, (error, reply) =>
      error ? reject(error) : resolve(reply),
    );
  });
}

async function main() {
  const opts = args(process.argv);
  const stub = client(opts);
  const view = await call(stub, "GetView", { thread_id: opts.thread });
  const state = JSON.parse(Buffer.from(view.state_json).toString("utf8"));
  console.log(JSON.stringify({ step: "view", version: view.version, state }));

  const reply = await call(stub, "ProposeTransition", {
    thread_id: opts.thread,
    expected_version: view.version,
    patch_json: Buffer.from(opts.patch, "utf8"),
    idempotency_key: `js-${Date.now()}-${process.pid}`,
  });
  // A node whose policy does not mark it read_records is told the version, its own
  // identity and the commit time; no record and no digest (docs/api.md).
  console.log(
    JSON.stringify({
      step: "committed",
      version: reply.transition.version,
      digest: reply.transition.digest,
      node_id: reply.transition.node_id,
    }),
  );

  try {
    await call(stub, "ProposeTransition", {
      thread_id: opts.thread,
      expected_version: reply.transition.version,
      patch_json: Buffer.from('{"is_admin": true}', "utf8"),
      idempotency_key: `js-refused-${Date.now()}`,
    });
    console.log(JSON.stringify({ step: "refused", code: "OK" }));
  } catch (error) {
    console.log(
      JSON.stringify({ step: "refused", code: grpc.status[error.code], message: error.details }),
    );
  }
  stub.close();
}

main().catch((error) => {
  console.error(`worker failed: ${error.message}`);
  process.exit(1);
});
