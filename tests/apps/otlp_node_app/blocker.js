// Express: POST /import parses its JSON body on the event loop again and again until
// BLOCKER_HOLD_MS (300) have passed by the process's clock, so it holds the loop at least that
// long however fast the machine is; POST /notes parses a small body once (clean). Run with
// `node --require ./tracing.js --require <repo>/node blocker.js`. Prints "listening PORT" when
// ready.
'use strict';
const { performance } = require('perf_hooks');
const express = require('express');

const app = express();
const raw = express.raw({ type: '*/*', limit: '256mb' });
const HOLD_MS = Number(process.env.BLOCKER_HOLD_MS || 300);

app.post('/import', raw, (req, res) => {
  const text = req.body.toString('utf8');
  const t0 = performance.now();
  let rows;
  let parses = 0;
  do {
    rows = JSON.parse(text);
    parses += 1;
  } while (performance.now() - t0 < HOLD_MS);
  res.json({ imported: rows.length, parses });
});

app.post('/notes', raw, (req, res) => {
  const note = JSON.parse(req.body.toString('utf8'));
  res.json({ saved: Object.keys(note).length });
});

const server = app.listen(0, '127.0.0.1', () => {
  console.log(`listening ${server.address().port}`);
});
