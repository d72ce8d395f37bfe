// Express: POST /import parses its (large) JSON body with JSON.parse on the event loop, which
// blocks it; POST /notes parses a small one (clean). Run with
// `node --require ./tracing.js --require <repo>/node app.js`. Prints "listening PORT" when ready.
'use strict';
const express = require('express');

const app = express();
const raw = express.raw({ type: '*/*', limit: '256mb' });

app.post('/import', raw, (req, res) => {
  const rows = JSON.parse(req.body.toString('utf8'));
  res.json({ imported: rows.length });
});

app.post('/notes', raw, (req, res) => {
  const note = JSON.parse(req.body.toString('utf8'));
  res.json({ saved: Object.keys(note).length });
});

const server = app.listen(0, '127.0.0.1', () => {
  console.log(`listening ${server.address().port}`);
});
