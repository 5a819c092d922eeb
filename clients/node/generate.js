#!/usr/bin/env node
// Calls RolloutService.Generate on a running Parity rollout service, from Node.js.
//
// It proves the gRPC API is usable without Python: the .proto files under ../../protos are loaded
// at run time by @grpc/proto-loader (no generated code), health is checked through the standard
// grpc.health.v1 service first, and the tokens, logprobs and per-token weight versions are printed.
//
//   node generate.js --address 127.0.0.1:50051 --prompt "What is 12+7?" --n 4 --max_tokens 16
//   node generate.js --address ... --json          # one JSON object on stdout (for scripts/tests)
//
// Exit codes: 0 ok; 1 the service is not SERVING or the call failed (the gRPC status is printed);
// 2 bad arguments.
"use strict";

const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const LOAD_OPTIONS = {
  keepCase: true, // field names exactly as in the .proto (snake_case)
  longs: Number, // int64 weight versions fit a double comfortably
  enums: String, // FINISH_REASON_STOP rather than 1
  defaults: true, // unset repeated fields arrive as [] and scalars as 0
  includeDirs: [PROTO_ROOT],
};

// grpc.health.v1, described as protobuf.js JSON so that no .proto needs to be vendored.
const HEALTH_DESCRIPTOR = {
  nested: {
    grpc: {
      nested: {
        health: {
          nested: {
            v1: {
              nested: {
                HealthCheckRequest: { fields: { service: { type: "string", id: 1 } } },
                HealthCheckResponse: {
                  fields: { status: { type: "ServingStatus", id: 1 } },
                  nested: {
                    ServingStatus: {
                      values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 },
                    },
                  },
                },
                Health: {
                  methods: {
                    Check: { requestType: "HealthCheckRequest", responseType: "HealthCheckResponse" },
                  },
                },
              },
            },
          },
        },
      },
    },
  },
};

function usage(message) {
  process.stderr.write(`error: ${message}\n`);
  process.stderr.write(
    "usage: node generate.js --address HOST:PORT [--prompt TEXT | --prompt_token_ids 1,2,3] " +
      "[--n 1] [--max_tokens 16] [--temperature 1.0] [--top_p 1.0] [--top_k 0] [--seed 0] " +
      "[--timeout_s 60] [--token T] [--json]\n",
  );
  process.exit(2);
}

function parseOptions(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        address: { type: "string" },
        prompt: { type: "string", default: "What is 12+7?" },
        prompt_token_ids: { type: "string", default: "" },
        n: { type: "string", default: "1" },
        max_tokens: { type: "string", default: "16" },
        temperature: { type: "string", default: "1.0" },
        top_p: { type: "string", default: "1.0" },
        top_k: { type: "string", default: "0" },
        seed: { type: "string", default: "0" },
        timeout_s: { type: "string", default: "60" },
        token: { type: "string", default: process.env.PARITY_AUTH_TOKEN || "" },
        json: { type: "boolean", default: false },
      },
    }));
  } catch (err) {
    usage(err.message);
  }
  if (!values.address) usage("--address is required");
  const numbers = {};
  for (const [name, isInt] of [
    ["n", true],
    ["max_tokens", true],
    ["top_k", true],
    ["seed", true],
    ["temperature", false],
    ["top_p", false],
    ["timeout_s", false],
  ]) {
    const value = Number(values[name]);
    if (!Number.isFinite(value) || value < 0 || (isInt && !Number.isInteger(value))) {
      usage(`--${name} must be a non-negative ${isInt ? "integer" : "number"}, got '${values[name]}'`);
    }
    numbers[name] = value;
  }
  if (numbers.timeout_s <= 0) usage("--timeout_s must be > 0");
  const promptTokenIds = values.prompt_token_ids
    ? values.prompt_token_ids.split(",").map((s) => Number(s.trim()))
    : [];
  if (promptTokenIds.some((t) => !Number.isInteger(t) || t < 0)) {
    usage("--prompt_token_ids must be comma-separated non-negative integers");
  }
  return { ...values, ...numbers, promptTokenIds };
}

function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

function call(client, method, request, metadata, seconds) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: deadline(seconds) }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

function loadServices() {
  const parity = grpc.loadPackageDefinition(
    protoLoader.loadSync(["parity/v1/rollout.proto"], LOAD_OPTIONS),
  ).parity.v1;
  const health = grpc.loadPackageDefinition(protoLoader.fromJSON(HEALTH_DESCRIPTOR, LOAD_OPTIONS)).grpc
    .health.v1;
  return { RolloutService: parity.RolloutService, Health: health.Health };
}

function printText(result) {
  const out = [];
  out.push(`${result.address}: ${result.health}, logprobs_mode=${result.logprobs_mode}`);
  out.push(`prompt_token_ids: [${result.prompt_token_ids.join(", ")}]`);
  for (const c of result.completions) {
    out.push(`completion ${c.index} (${c.finish_reason}, ${c.token_ids.length} tokens): ${JSON.stringify(c.text)}`);
    out.push("  token   logprob   version");
    c.token_ids.forEach((token, i) => {
      out.push(
        `  ${String(token).padStart(5)}  ${c.logprobs[i].toFixed(4).padStart(8)}  ${String(
          c.token_weight_versions[i],
        ).padStart(8)}`,
      );
    });
  }
  process.stdout.write(out.join("\n") + "\n");
}

async function main() {
  const options = parseOptions(process.argv.slice(2));
  const { RolloutService, Health } = loadServices();
  const credentials = grpc.credentials.createInsecure();
  const channelOptions = { "grpc.max_receive_message_length": 64 * 1024 * 1024 };
  const health = new Health(options.address, credentials, channelOptions);
  const rollout = new RolloutService(options.address, credentials, channelOptions);
  const metadata = new grpc.Metadata();
  if (options.token) metadata.set("authorization", `Bearer ${options.token}`);
  try {
    const status = await call(health, "Check", { service: "" }, new grpc.Metadata(), options.timeout_s);
    if (status.status !== "SERVING") {
      process.stderr.write(`${options.address} is ${status.status}, not SERVING\n`);
      return 1;
    }
    const request = {
      request_id: `node-${process.pid}-${Date.now()}`,
      prompt_text: options.promptTokenIds.length ? "" : options.prompt,
      prompt_token_ids: options.promptTokenIds,
      sampling: {
        temperature: options.temperature,
        top_p: options.top_p,
        top_k: options.top_k,
        max_tokens: options.max_tokens,
        n: options.n,
        seed: options.seed,
      },
    };
    const reply = await call(rollout, "Generate", request, metadata, options.timeout_s);
    const result = {
      address: options.address,
      health: status.status,
      request_id: reply.request_id,
      logprobs_mode: reply.logprobs_mode,
      prompt_token_ids: reply.prompt_token_ids,
      completions: reply.completions.map((c) => ({
        index: c.index,
        token_ids: c.token_ids,
        logprobs: c.logprobs,
        token_weight_versions: c.token_weight_versions,
        text: c.text,
        finish_reason: c.finish_reason,
      })),
    };
    if (options.json) process.stdout.write(JSON.stringify(result) + "\n");
    else printText(result);
    return 0;
  } catch (err) {
    const code = err.code !== undefined ? grpc.status[err.code] : "ERROR";
    process.stderr.write(`${options.address}: ${code}: ${err.details || err.message}\n`);
    return 1;
  } finally {
    health.close();
    rollout.close();
  }
}

main().then((code) => process.exit(code));
