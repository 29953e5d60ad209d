// A Hub imitation for the browser suite: the files of a directory served as one repository at
// one commit over the Hub's HTTP API (revision, recursive tree, resolve with `Range`), plain git
// blobs (ETag = git blob sha1). Options shape how the downloads behave:
// - `bytesPerSecond`: bodies throttled over all connections, so a download lasts long enough to
//   be watched whatever the speed of the machine;
// - `failFiles`: every file download answers 500 (a download that fails, and is retried);
// - `stalled`: a GET of that file answers its headers and never its body, so the download
//   completes every other file and then waits until the test ends.

import { createHash } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { join } from 'node:path';

/** Starts the imitation; `{ server, endpoint, total, done }` (`done`: bytes of the files that complete). */
export async function hubImitation(repo, dir, { bytesPerSecond = Infinity, failFiles = false, stalled = null } = {}) {
  // The commit depends on the repository name alone, so pages that show it look the same on every
  // machine (the visual baselines were made with this value).
  const sha = createHash('sha1').update(`${repo}@visual`).digest('hex');
  const files = new Map(readdirSync(dir).sort().map((name) => {
    const data = readFileSync(join(dir, name));
    const oid = createHash('sha1').update(`blob ${data.length}\0`).update(data).digest('hex');
    return [name, { data, oid }];
  }));
  let nextFree = Date.now();
  const server = createServer(async (req, res) => {
    const url = new URL(req.url, 'http://hub');
    const json = (v) => { res.writeHead(200, { 'content-type': 'application/json', etag: `"${sha}"` }); res.end(JSON.stringify(v)); };
    if (url.pathname === `/api/models/${repo}/revision/main`) {
      return json({ id: repo, sha, siblings: [...files.keys()].map((rfilename) => ({ rfilename })) });
    }
    if (url.pathname === `/api/models/${repo}/tree/${sha}` || url.pathname === `/api/models/${repo}/tree/main`) {
      return json([...files].map(([path, f]) => ({ type: 'file', oid: f.oid, size: f.data.length, path })));
    }
    if (failFiles) {
      res.writeHead(500, { 'content-type': 'application/json' });
      return res.end(JSON.stringify({ error: 'Internal error' }));
    }
    const prefix = `/${repo}/resolve/${sha}/`;
    const name = url.pathname.startsWith(prefix) ? decodeURIComponent(url.pathname.slice(prefix.length)) : '';
    const f = files.get(name);
    if (!f) {
      res.writeHead(404, { 'content-type': 'application/json', 'x-error-code': 'EntryNotFound' });
      return res.end(JSON.stringify({ error: 'Entry not found' }));
    }
    let [start, end] = [0, f.data.length];
    const range = /^bytes=(\d+)-(\d*)$/.exec(req.headers.range || '');
    if (range) [start, end] = [Number(range[1]), range[2] ? Math.min(Number(range[2]) + 1, end) : end];
    const headers = { 'content-length': end - start, 'accept-ranges': 'bytes', etag: `"${f.oid}"`, 'x-repo-commit': sha };
    if (range) headers['content-range'] = `bytes ${start}-${end - 1}/${f.data.length}`;
    res.writeHead(range ? 206 : 200, headers);
    if (req.method === 'HEAD') return res.end();
    if (name === stalled) return res.flushHeaders();
    if (bytesPerSecond === Infinity) return res.end(f.data.subarray(start, end));
    for (let at = start; at < end && !res.destroyed; at += 64 << 10) {
      const piece = f.data.subarray(at, Math.min(at + (64 << 10), end));
      const now = Date.now();
      nextFree = Math.max(now, nextFree) + (piece.length * 1000) / bytesPerSecond;
      await new Promise((r) => setTimeout(r, nextFree - now));
      if (!res.write(piece)) await new Promise((r) => res.once('drain', r));
    }
    res.end();
  });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  const sizes = [...files].map(([name, f]) => [name, f.data.length]);
  return { server, endpoint: `http://127.0.0.1:${server.address().port}`,
    total: sizes.reduce((n, [, b]) => n + b, 0), done: sizes.reduce((n, [k, b]) => n + (k === stalled ? 0 : b), 0) };
}
