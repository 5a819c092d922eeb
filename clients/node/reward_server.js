#!/usr/bin/env node
// A Parity reward written in Node.js: implements parity.v1.RewardService (protos/parity/v1/reward.proto).
//
// It proves a grader can live outside Python, in its own process: Parity calls Score with a batch of
// completions (one GRPO group) and gets one score per completion. This one grades numeric answers:
// 1 when the last number in the completion equals the item's answer as a number (thousands commas
// allowed), else 0. Use it with:
//
//   node clients/node/reward_server.js --port 50070
//   parity run --task jsonl:examples/gsm8k_mini.jsonl --reward grpc:127.0.0.1:50070
//
// The .proto files are loaded at run time by @grpc/proto-loader (no generated code). The server binds
// 127.0.0.1 unless --host says otherwise, answers grpc.health.v1 Check with SERVING, and answers a
// malformed request with INVALID_ARGUMENT and a details string naming the field. --port 0 picks a
// free port; --port_file FILE receives it once serving. SIGINT/SIGTERM stop it gracefully.
//
// Exit codes: 0 stopped by a signal; 1 could not bind; 2 bad arguments.
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const MAX_ITEMS = 4096;
const NUMBER = /-?\d(?:[\d,]*\d)?(?:\.\d+)?/g;

function usage(message) {
  process.stderr.write(`error: ${message}\n`);
  process.stderr.write("usage: node reward_server.js [--host 127.0.0.1] [--port 0] [--port_file FILE]\n");
  process.exit(2);
}

function parseOptions(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        host: { type: "string", default: "127.0.0.1" },
        port: { type: "string", default: "0" },
        port_file: { type: "string", default: "" },
      },
    }));
  } catch (err) {
    usage(err.message);
  }
  const port = Number(values.port);
  if (!Number.isInteger(port) || port < 0 || port > 65535) usage(`--port: expected 0..65535, got ${values.port}`);
  return { host: values.host, port, portFile: values.port_file };
}

function asNumber(text) {
  const value = Number(String(text).replace(/,/g, "").trim());
  return Number.isFinite(value) ? value : null;
}

// 1 when the completion's last number equals the answer, else 0.
function grade(completion, answer) {
  const found = completion.match(NUMBER);
  if (!found) return 0;
  const last = asNumber(found[found.length - 1]);
  return last !== null && last === asNumber(answer) ? 1 : 0;
}

function invalid(callback, details) {
  callback({ code: grpc.status.INVALID_ARGUMENT, details });
}

function score(call, callback) {
  const items = call.request.items || [];
  if (items.length === 0) return invalid(callback, "items: at least one item is required");
  if (items.length > MAX_ITEMS) return invalid(callback, `items: at most ${MAX_ITEMS}, got ${items.length}`);
  const scores = [];
  for (let i = 0; i < items.length; i++) {
    if (asNumber(items[i].answer) === null) {
      return invalid(callback, `items[${i}].answer: not a number (${JSON.stringify(items[i].answer)})`);
    }
    scores.push(grade(items[i].completion, items[i].answer));
  }
  callback(null, { scores });
}

function healthService() {
  const definition = protoLoader.fromJSON({
    nested: {
      grpc: { nested: { health: { nested: { v1: { nested: {
        HealthCheckRequest: { fields: { service: { type: "string", id: 1 } } },
        HealthCheckResponse: { fields: { status: { type: "int32", id: 1 } } },
        Health: { methods: { Check: { requestType: "HealthCheckRequest", responseType: "HealthCheckResponse" } } },
      } } } } } },
    },
  });
  return grpc.loadPackageDefinition(definition).grpc.health.v1.Health.service;
}

function main() {
  const options = parseOptions(process.argv.slice(2));
  const definition = protoLoader.loadSync(path.join(PROTO_ROOT, "parity", "v1", "reward.proto"), {
    keepCase: true,
    defaults: true,
    includeDirs: [PROTO_ROOT],
  });
  const parity = grpc.loadPackageDefinition(definition).parity.v1;
  const server = new grpc.Server();
  server.addService(parity.RewardService.service, { Score: score });
  server.addService(healthService(), { Check: (call, callback) => callback(null, { status: 1 }) });
  const address = options.host.includes(":") ? `[${options.host}]:${options.port}` : `${options.host}:${options.port}`;
  server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      process.stderr.write(`reward_server: cannot bind ${address}: ${err.message}\n`);
      process.exit(1);
    }
    if (options.portFile) {
      const tmp = `${options.portFile}.tmp`;
      fs.writeFileSync(tmp, `${port}\n`);
      fs.renameSync(tmp, options.portFile);
    }
    process.stdout.write(`reward_server: RewardService serving on ${options.host}:${port}\n`);
  });
  const stop = () => server.tryShutdown(() => process.exit(0));
  process.on("SIGINT", stop);
  process.on("SIGTERM", stop);
}

main();
