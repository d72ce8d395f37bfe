// Express + pg: GET /users/:id/posts loads each post's comments one query at a time (a
// planted N+1); GET /users/:id is one query (clean). Prints "listening PORT" when ready.
'use strict';
const express = require('express');
const { Pool } = require('pg');

const suffix = process.env.TABLE_SUFFIX;
const posts = `otlp_posts_${suffix}`;
const comments = `otlp_comments_${suffix}`;
const pool = new Pool({ connectionString: process.env.DATABASE_URL, max: 2 });
const app = express();

app.get('/users/:id', async (req, res) => {
  const r = await pool.query(`SELECT count(*) AS n FROM ${posts} WHERE user_id = $1`, [
    req.params.id,
  ]);
  res.json(r.rows[0]);
});

app.get('/users/:id/posts', async (req, res) => {
  const client = await pool.connect();
  try {
    const ps = await client.query(`SELECT id FROM ${posts} WHERE user_id = $1`, [req.params.id]);
    const out = [];
    for (const p of ps.rows) {
      const c = await client.query(`SELECT body FROM ${comments} WHERE post_id = $1`, [p.id]);
      out.push({ id: p.id, comments: c.rows.length });
    }
    res.json(out);
  } finally {
    client.release();
  }
});

async function main() {
  const c = await pool.connect();
  try {
    await c.query(`CREATE TABLE ${posts} (id int primary key, user_id int)`);
    await c.query(`CREATE TABLE ${comments} (post_id int, body text)`);
    await c.query(`INSERT INTO ${posts} SELECT g, 1 FROM generate_series(1, 20) g`);
    await c.query(`INSERT INTO ${comments} SELECT g % 20 + 1, 'hi' FROM generate_series(1, 60) g`);
  } finally {
    c.release();
  }
  const server = app.listen(0, '127.0.0.1', () => {
    console.log(`listening ${server.address().port}`);
  });
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
