#!/usr/bin/env node
// A Parity environment written in Node.js: implements parity.v1.EnvironmentService
// (protos/parity/v1/environment.proto), the guess-a-number game of env:guess_number.
//
// It proves an environment can live outside Python, in its own process: Parity resets an episode on a
// record, sends each model turn to Step and gets back an observation, a reward and done. The game: a
// secret integer in [1, high]; each turn's first integer is a guess, answered "Higher."/"Lower."; a
// win on guess g of k scores 1 - 0.5 * (g - 1) / k; running out of guesses scores 0. Use it with:
//
//   node clients/node/env_server.js --port 50080
//   parity run --task env:grpc:127.0.0.1:50080
//
// Idempotency (so Parity may retry): Reset with a known episode_id starts that episode again; Step
// with an earlier step_index answers the reply it gave then, without stepping twice; Close of an
// unknown episode succeeds. State lives in memory, keyed by episode_id.
//
// Auth: when PARITY_AUTH_TOKEN is set, every EnvironmentService call needs
// `authorization: Bearer <token>` metadata (UNAUTHENTICATED otherwise); Parity's client sends it
// from the same variable. The server binds 127.0.0.1 unless --host says otherwise, answers
// grpc.health.v1 Check with SERVING, and answers a malformed request with INVALID_ARGUMENT and a
// details string naming the field. --port 0 picks a free port, printed once serving;
// --port_file FILE receives it too. SIGINT/SIGTERM stop it gracefully.
//
// Exit codes: 0 stopped by a signal; 1 could not bind; 2 bad arguments.
"use strict";

const crypto = require("node:crypto");
const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const LOAD_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO_ROOT] };
const MAX_EPISODES = 10000;
const MAX_PAGE = 4096;
const HELD_OUT_PERCENT = 20;

function usage(message) {
  process.stderr.write(`error: ${message}\n`);
  process.stderr.write("usage: node env_server.js [--host 127.0.0.1] [--port 0] [--port_file FILE]\n");
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

// --- records: every (high, secret) pair, split once by a hash of the id ---------------------------

function digest(text) {
  return crypto.createHash("sha256").update(text).digest();
}

function buildRecords() {
  const train = [];
  const heldOut = [];
  for (let high = 8; high <= 24; high++) {
    for (let secret = 1; secret <= high; secret++) {
      const record = { id: `guess-${high}-${secret}`, high, secret, max_guesses: Math.floor(Math.log2(high)) + 1 };
      ((digest(record.id)[0] * 100) >> 8 < HELD_OUT_PERCENT ? heldOut : train).push(record);
    }
  }
  heldOut.sort((a, b) => Buffer.compare(digest(`eval:${a.id}`), digest(`eval:${b.id}`)));
  return { train, heldOut };
}

const RECORDS = buildRecords();

// The training stream's record at `index` for `seed`: computed alone, so any page can be served.
function trainRecord(seed, index) {
  return RECORDS.train[digest(`${seed}:${index}`).readUInt32BE(0) % RECORDS.train.length];
}

// --- google.protobuf.Struct <-> plain objects -------------------------------------------------------

function fromValue(value) {
  switch (value.kind) {
    case "numberValue": return value.numberValue;
    case "stringValue": return value.stringValue;
    case "boolValue": return value.boolValue;
    case "structValue": return fromStruct(value.structValue);
    case "listValue": return (value.listValue.values || []).map(fromValue);
    default: return null;
  }
}

function fromStruct(struct) {
  const out = {};
  for (const [key, value] of Object.entries((struct && struct.fields) || {})) out[key] = fromValue(value);
  return out;
}

function toValue(value) {
  if (value === null || value === undefined) return { nullValue: "NULL_VALUE" };
  if (typeof value === "number") return { numberValue: value };
  if (typeof value === "string") return { stringValue: value };
  if (typeof value === "boolean") return { boolValue: value };
  if (Array.isArray(value)) return { listValue: { values: value.map(toValue) } };
  return { structValue: toStruct(value) };
}

function toStruct(object) {
  const fields = {};
  for (const [key, value] of Object.entries(object)) fields[key] = toValue(value);
  return { fields };
}

// --- the game -----------------------------------------------------------------------------------

class RequestError extends Error {
  constructor(code, details) {
    super(details);
    this.code = code;
    this.details = details;
  }
}

const invalid = (details) => new RequestError(grpc.status.INVALID_ARGUMENT, details);

function wholeNumber(record, field, min, max) {
  const value = record[field];
  if (!Number.isInteger(value) || value < min || value > max) {
    throw invalid(`record.${field}: expected an integer in ${min}..${max}, got ${JSON.stringify(value)}`);
  }
  return value;
}

function newEpisode(record) {
  const high = wholeNumber(record, "high", 1, 1000000);
  return {
    high,
    secret: wholeNumber(record, "secret", 1, high),
    maxGuesses: wholeNumber(record, "max_guesses", 1, 100),
    guesses: 0,
    done: false,
    replies: [], // replies[i] answers step_index i (a retried Step gets the same one)
  };
}

function play(episode, action) {
  episode.guesses += 1;
  const left = episode.maxGuesses - episode.guesses;
  const match = /-?\d+/.exec(action);
  const guess = match ? Number(match[0]) : null;
  if (guess === episode.secret) {
    const reward = 1 - (0.5 * (episode.guesses - 1)) / episode.maxGuesses;
    return { observation: `Correct! The number was ${episode.secret}.`, reward, done: true };
  }
  if (left <= 0) return { observation: `Out of guesses: the number was ${episode.secret}.`, reward: 0, done: true };
  const rest = `${left} ${left === 1 ? "guess" : "guesses"} left.`;
  if (guess === null || guess < 1 || guess > episode.high) {
    return { observation: `Reply with one number between 1 and ${episode.high}. ${rest}`, reward: 0, done: false };
  }
  return { observation: `${guess < episode.secret ? "Higher" : "Lower"}. ${rest}`, reward: 0, done: false };
}

function introduction(episode) {
  return (
    `I am thinking of a whole number between 1 and ${episode.high}. Guess it: reply with just one ` +
    `number. After each guess I say higher or lower. You have ${episode.maxGuesses} guesses.`
  );
}

function makeService() {
  const episodes = new Map();

  function episodeId(request) {
    if (!request.episode_id) throw invalid("episode_id: required");
    return request.episode_id;
  }

  return {
    Reset(request) {
      const id = episodeId(request);
      if (!episodes.has(id) && episodes.size >= MAX_EPISODES) {
        throw new RequestError(grpc.status.RESOURCE_EXHAUSTED, `episodes: ${MAX_EPISODES} open; close some first`);
      }
      const episode = newEpisode(fromStruct(request.record));
      episodes.set(id, episode); // a repeated Reset starts the same episode again
      return { observation: introduction(episode) };
    },
    Step(request) {
      const id = episodeId(request);
      const episode = episodes.get(id);
      if (!episode) throw new RequestError(grpc.status.NOT_FOUND, `episode_id: no open episode ${JSON.stringify(id)}`);
      const index = request.step_index;
      if (index < episode.replies.length) return episode.replies[index]; // a retry: same reply, no second step
      if (index > episode.replies.length) {
        throw new RequestError(grpc.status.FAILED_PRECONDITION, `step_index: expected ${episode.replies.length}, got ${index}`);
      }
      if (episode.done) throw new RequestError(grpc.status.FAILED_PRECONDITION, "step_index: the episode is over");
      const reply = play(episode, request.action);
      episode.done = reply.done;
      episode.replies.push(reply);
      return reply;
    },
    Close(request) {
      episodes.delete(episodeId(request));
      return {};
    },
    ListRecords(request) {
      const { split, seed, offset, limit } = request;
      if (limit < 1 || limit > MAX_PAGE) throw invalid(`limit: expected 1..${MAX_PAGE}, got ${limit}`);
      let records;
      if (split === "RECORD_SPLIT_TRAIN") {
        records = Array.from({ length: limit }, (_, i) => trainRecord(seed, offset + i));
      } else if (split === "RECORD_SPLIT_EVAL") {
        records = RECORDS.heldOut.slice(offset, offset + limit);
      } else {
        throw invalid(`split: expected RECORD_SPLIT_TRAIN or RECORD_SPLIT_EVAL, got ${split}`);
      }
      return { records: records.map(toStruct) };
    },
  };
}

// Wraps a handler: the auth check, and thrown RequestErrors as statuses.
function unary(handler, token) {
  const expected = Buffer.from(`Bearer ${token}`);
  return (call, callback) => {
    if (token) {
      const given = Buffer.from(String(call.metadata.get("authorization")[0] || ""));
      if (given.length !== expected.length || !crypto.timingSafeEqual(given, expected)) {
        callback({ code: grpc.status.UNAUTHENTICATED, details: "authorization: needs 'Bearer <token>' metadata" });
        return;
      }
    }
    try {
      callback(null, handler(call.request));
    } catch (err) {
      if (err instanceof RequestError) callback({ code: err.code, details: err.details });
      else callback({ code: grpc.status.INTERNAL, details: `internal error: ${err.message}` });
    }
  };
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
  const token = process.env.PARITY_AUTH_TOKEN || "";
  const definition = protoLoader.loadSync(path.join(PROTO_ROOT, "parity", "v1", "environment.proto"), LOAD_OPTIONS);
  const parity = grpc.loadPackageDefinition(definition).parity.v1;
  const service = makeService();
  const server = new grpc.Server();
  server.addService(parity.EnvironmentService.service, {
    Reset: unary(service.Reset, token),
    Step: unary(service.Step, token),
    Close: unary(service.Close, token),
    ListRecords: unary(service.ListRecords, token),
  });
  server.addService(healthService(), { Check: (call, callback) => callback(null, { status: 1 }) });
  const address = options.host.includes(":") ? `[${options.host}]:${options.port}` : `${options.host}:${options.port}`;
  server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      process.stderr.write(`env_server: cannot bind ${address}: ${err.message}\n`);
      process.exit(1);
    }
    if (options.portFile) {
      const tmp = `${options.portFile}.tmp`;
      fs.writeFileSync(tmp, `${port}\n`);
      fs.renameSync(tmp, options.portFile);
    }
    process.stdout.write(`env_server: EnvironmentService serving on ${options.host}:${port}\n`);
  });
  const stop = () => server.tryShutdown(() => process.exit(0));
  process.on("SIGINT", stop);
  process.on("SIGTERM", stop);
}

main();
