// perfsleuth-node: event-loop blockers of a Node.js service as OpenTelemetry spans.
//
//   node --require ./tracing.js --require perfsleuth-node app.js
//
// Preloaded next to the OpenTelemetry SDK (either order), it times every callback the event
// loop runs (async_hooks before/after) and every context entered in it (the context manager's
// `with`, which the instrumentations use to run a handler under its span). A callback that keeps
// the loop for PERFSLEUTH_LOOP_BLOCK_MS (100) or more is a block: it is reported as a span
// `perfsleuth.loop_block` (start and end of the block) whose parent is the span that was active
// in the innermost timed frame that blocked, the code that held the loop, with
//   perfsleuth.block.ms       how long the loop was held
//   perfsleuth.block.delayed  HTTP requests in flight besides that one (they waited)
// and exported by the SDK's own exporter. perfsleuth's OTLP ingest files it under the request
// (the SERVER span above it): the event_loop_blocker finding names that endpoint. Nothing is
// recorded while the loop is blocked (that is not possible); the timing costs two clock reads
// per callback (and two per context entered). PERFSLEUTH_LOOP_BLOCK_MS=0 turns it off.
'use strict';

const asyncHooks = require('async_hooks');
const dc = require('diagnostics_channel');
const Module = require('module');
const path = require('path');
const { performance } = require('perf_hooks');

const SPAN_NAME = 'perfsleuth.loop_block';
const PATCHED = Symbol.for('perfsleuth.node.patched');
const VERSION = '0.1.0';

function loadApi() {
  // The application's copy of the API (where the SDK registered its providers), else ours.
  try {
    return Module.createRequire(path.join(process.cwd(), 'index.js'))('@opentelemetry/api');
  } catch (e) {
    return require('@opentelemetry/api');
  }
}

let api = null;
let threshold = 100;
let hook = null;
const frames = []; // start times (performance.now() ms) of the frames open on the loop
let lastEnd = -1; // end of the last block recorded: frames around it are the same block
let inflight = 0;

function onExit(t0, spanOf) {
  const t1 = performance.now();
  if (t1 - t0 < threshold || t0 < lastEnd) return;
  const span = spanOf();
  // A frame without a span leaves the block to an enclosing frame that may have one.
  if (span === undefined && frames.length > 0) return;
  lastEnd = t1;
  // Recorded now, not later: the request's own span ends (and is exported) once its response
  // is flushed, and the block should reach the collector no later than it.
  try {
    const parent = span !== undefined ? api.trace.setSpan(api.ROOT_CONTEXT, span) : api.ROOT_CONTEXT;
    const s = api.trace.getTracer('perfsleuth-node', VERSION).startSpan(
      SPAN_NAME,
      {
        kind: api.SpanKind.INTERNAL,
        startTime: performance.timeOrigin + t0,
        attributes: {
          'perfsleuth.block.ms': Math.round((t1 - t0) * 1000) / 1000,
          'perfsleuth.block.delayed': Math.max(inflight - 1, 0),
        },
      },
      parent,
    );
    s.end(performance.timeOrigin + t1);
  } catch (e) {
    // never fail the application (an exception thrown in an async hook would end the process)
  }
}

function activeSpan() {
  return api.trace.getActiveSpan();
}

function patchContextManager() {
  // The registered context manager's `with`: the frame of a handler run under its span.
  let manager;
  try {
    manager = api.context._getContextManager();
  } catch (e) {
    return true;
  }
  if (!manager || manager.constructor.name === 'NoopContextManager') return false;
  if (manager[PATCHED]) return true;
  const original = manager.with;
  manager.with = function (ctx, fn, thisArg, ...args) {
    const t0 = performance.now();
    frames.push(t0);
    try {
      return original.call(this, ctx, fn, thisArg, ...args);
    } finally {
      frames.pop();
      onExit(t0, () => api.trace.getSpan(ctx));
    }
  };
  manager[PATCHED] = true;
  return true;
}

function start(options = {}) {
  if (hook !== null) return;
  const env = process.env.PERFSLEUTH_LOOP_BLOCK_MS;
  threshold = Number(options.thresholdMs ?? (env !== undefined && env !== '' ? env : 100));
  if (!(threshold > 0)) return;
  try {
    api = loadApi();
  } catch (e) {
    process.emitWarning('perfsleuth-node: @opentelemetry/api not found; loop blocks are not recorded');
    return;
  }
  hook = asyncHooks.createHook({
    before() {
      frames.push(performance.now());
    },
    after() {
      const t0 = frames.pop();
      if (t0 !== undefined) onExit(t0, activeSpan);
    },
  });
  hook.enable();
  // An uncaught exception skips the `after` of the callbacks it unwound.
  process.on('uncaughtExceptionMonitor', () => {
    frames.length = 0;
  });
  dc.subscribe('http.server.request.start', () => {
    inflight++;
  });
  dc.subscribe('http.server.response.finish', () => {
    inflight = Math.max(inflight - 1, 0);
  });
  // The SDK may be started after this module is loaded: try again once the preloads ran.
  if (!patchContextManager()) {
    let tries = 0;
    const retry = () => {
      if (!patchContextManager() && ++tries < 50) setTimeout(retry, 100).unref();
    };
    setImmediate(retry);
  }
}

function stop() {
  if (hook !== null) hook.disable();
  hook = null;
}

start();

module.exports = { start, stop, SPAN_NAME };
