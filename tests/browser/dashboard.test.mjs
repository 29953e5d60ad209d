// End-to-end test of the dashboard in real headless Chromium (Debian's `chromium` package):
// the real `shardline` binary serves the API and the dashboard on a temporary SQLite store, a
// real worker runs the demo pipeline, and the page submits, follows, inspects and cancels runs,
// and shows what the worker's gc measured.
// Fails (never skips) when Chromium or the binary is missing.
//
//   SHARDLINE_BIN   the binary (default: target/debug/shardline)
//   CHROMIUM        the browser (default: /usr/bin/chromium)

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, mkdirSync, readFileSync, rmSync, openSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { invisibleFocus, seriousViolations } from './a11y.mjs';
import { hubImitation } from './hub.mjs';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.SHARDLINE_BIN || join(ROOT, 'target/debug/shardline');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const OUT = join(ROOT, 'target/browser');
const SCREENSHOT = join(OUT, 'run-page.png');
const FIXTURE = join(ROOT, 'tests/fixtures/hf-tiny/qwen3_next');

const tmp = mkdtempSync(join(tmpdir(), 'shardline-browser-'));
const stateDir = join(tmp, 'state');
const procs = [];
const servers = [];
let base = '';
let browser = null;
let submitToken = '';
let adminToken = '';

function cli(...args) {
  return execFileSync(BIN, [...args, '--state-dir', stateDir], { cwd: tmp, encoding: 'utf8', env: cleanEnv() });
}

function cleanEnv() {
  // Workers keep nothing of the disk free: the tests need little scratch, and a nearly full
  // machine must not stall their rank tasks.
  const env = { ...process.env, HF_HOME: join(tmp, 'hf-home'), SHARDLINE_SCRATCH_RESERVE: '0' };
  delete env.SHARDLINE_DATABASE_URL;
  delete env.HF_HUB_CACHE;
  delete env.HF_ENDPOINT;
  delete env.HF_TOKEN;
  return env;
}

/** A Hub imitation (hub.mjs) whose bodies come at `bytesPerSecond`; closed when the tests end. */
async function slowHub(repo, dir, bytesPerSecond, { failFiles = false } = {}) {
  const hub = await hubImitation(repo, dir, { bytesPerSecond, failFiles });
  servers.push(hub.server);
  return hub;
}

function start(name, args) {
  const log = join(tmp, `${name}.log`);
  const fd = openSync(log, 'w');
  const child = spawn(BIN, [...args, '--state-dir', stateDir], { cwd: tmp, stdio: ['ignore', fd, fd], env: cleanEnv() });
  procs.push({ name, child, log });
  return { child, log };
}

function logs() {
  return procs.map((p) => `--- ${p.name} ---\n${existsSync(p.log) ? readFileSync(p.log, 'utf8').slice(-4000) : ''}`).join('\n');
}

async function until(what, fn, timeoutMs = 30000) {
  const end = Date.now() + timeoutMs;
  let last;
  while (Date.now() < end) {
    try {
      last = await fn();
      if (last) return last;
    } catch (e) {
      last = e;
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for ${what} (last: ${last})\n${logs()}`);
}

/** The demo pipeline with paths of this test: the bundled tiny release, output under tmp. */
function demoSpec(name, extra = '') {
  const demo = readFileSync(join(ROOT, 'pipelines/demo.yaml'), 'utf8');
  const spec = demo
    .replace(/^name: demo$/m, `name: ${name}`)
    .replace('default: tests/fixtures/hf-tiny/qwen3_next', `default: ${FIXTURE}`)
    .replace('file://.shardline/out/${{ run.id }}', `file://${tmp}/out/\${{ run.id }}`);
  assert.ok(spec.includes(FIXTURE) && spec.includes(`file://${tmp}/out/`), 'pipelines/demo.yaml changed: update this test');
  return spec + extra;
}

before(async () => {
  assert.ok(existsSync(BIN), `${BIN} is missing: build it first (cargo build --bin shardline)`);
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: apt-get install chromium (scripts/test installs it)`);
  assert.ok(existsSync(join(FIXTURE, 'config.json')), `${FIXTURE} is missing`);
  mkdirSync(OUT, { recursive: true });
  rmSync(SCREENSHOT, { force: true });
  mkdirSync(stateDir, { recursive: true });
  submitToken = cli('token', 'create', '--scope', 'submit', '--name', 'browser-submit').trim();
  adminToken = cli('token', 'create', '--scope', 'admin', '--name', 'browser-admin').trim();
  assert.match(submitToken, /^shl_[0-9a-f]{64}$/);
  const listed = cli('token', 'list');
  assert.ok(listed.includes('browser-submit') && !listed.includes(submitToken), 'token list shows names, never secrets');

  // A pipeline with a schedule trigger (02:00 UTC: it does not fire during the test).
  const pipelines = join(tmp, 'pipelines');
  mkdirSync(pipelines, { recursive: true });
  writeFileSync(join(pipelines, 'nightly.yaml'), demoSpec('browser-nightly')
    .replace('steps:\n', 'triggers:\n  - schedule: {cron: "0 2 * * *", timezone: UTC}\nsteps:\n'));
  const server = start('server', ['server', '--http', '127.0.0.1:0', '--public-reads', '--pipelines', pipelines]);
  base = await until('the server to listen', () => {
    const m = readFileSync(server.log, 'utf8').match(/http:\/\/(127\.0\.0\.1:\d+)\//);
    return m ? `http://${m[1]}` : null;
  });
  // Short leases: heartbeats (and the progress they carry) every 0.67 s. Its gc measures (and,
  // with no retention set, frees nothing) every 2 s, for the storage page.
  start('worker', ['worker', '--name', 'browser-worker', '--cpus', '4', '--memory', '8GiB', '--lease-seconds', '2', '--gc-every', '2s']);
  await until('the worker to register', async () => {
    const r = await fetch(`${base}/api/v1/workers`);
    return r.ok && (await r.json()).some((w) => w.name === 'browser-worker');
  });
  // A fresh profile (user data directory) under the test's temporary directory.
  browser = await chromium.launchPersistentContext(join(tmp, 'chromium-profile'), {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1400, height: 1000 },
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  });
});

after(async () => {
  if (browser) await browser.close();
  for (const p of procs) {
    if (p.child.exitCode === null) p.child.kill('SIGTERM');
  }
  await Promise.all(procs.map((p) => (p.child.exitCode === null ? new Promise((r) => { p.child.once('exit', r); setTimeout(r, 15000); }) : null)));
  for (const p of procs) if (p.child.exitCode === null) p.child.kill('SIGKILL');
  for (const s of servers) s.close();
  rmSync(tmp, { recursive: true, force: true });
});

/** A page that records console errors, page errors and failed requests. */
async function newPage() {
  const page = await browser.newPage();
  const context = { close: () => page.close() };
  const problems = [];
  page.on('console', (m) => { if (m.type() === 'error') problems.push(`console: ${m.text()}`); });
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  page.on('requestfailed', (r) => {
    // Requests still in flight when a page is left are aborted by the browser (event streams
    // always are); any other failure is a problem.
    const why = r.failure()?.errorText || '';
    if (why !== 'net::ERR_ABORTED') problems.push(`request failed: ${r.url()} ${why}`);
  });
  page.on('dialog', (d) => d.accept());
  return { context, page, problems };
}

async function setToken(page, token) {
  await page.click('nav a[data-nav="token"]');
  await page.fill('[data-testid=token-input]', token);
  await page.click('[data-testid=token-save]');
  await page.waitForFunction(() => document.querySelector('[data-testid=token-status]')?.textContent.includes('The server accepts it.'));
  // The event stream reconnects with the token.
  await page.waitForFunction(() => document.getElementById('live')?.textContent === 'live');
}

test('submit, follow, inspect logs and cancel from the dashboard', { timeout: 240000 }, async () => {
  const { context, page, problems } = await newPage();
  await page.goto(`${base}/`);
  await page.waitForSelector('[data-testid=runs-table]');
  await page.waitForFunction(() => document.getElementById('live')?.textContent === 'live');
  await setToken(page, submitToken);
  assert.deepEqual(await seriousViolations(page), [], 'the token page');

  // A broken spec: the lint error is shown at its line before anything is submitted.
  await page.click('nav a[data-nav="submit"]');
  // Markup in a spec is text on every page (a markup injection would also trip the CSP and
  // log an error).
  const evil = '<img src=x onerror=window.__xss=1>';
  const broken = demoSpec('browser-demo').replace('uses: megatron.split_fused', `uses: "megatron.split_fuzed${evil}"`);
  const badLine = broken.split('\n').findIndex((l) => l.includes('split_fuzed')) + 1;
  await page.fill('[data-testid=spec-input]', broken);
  const diag = await page.waitForSelector(`[data-testid=diagnostic][data-line="${badLine}"]`);
  assert.match(await diag.textContent(), /megatron\.split_fuzed/);
  assert.ok((await page.textContent('[data-testid=lint-inline]')).includes(evil), 'the spec text is not shown as written');
  assert.equal(await page.locator('[data-testid=lint-inline] img').count(), 0);
  assert.deepEqual(await seriousViolations(page), [], 'the submit page with lint errors shown');
  assert.deepEqual(await invisibleFocus(page, 20), [], 'keyboard focus must be visible on the submit page');
  assert.equal(await page.getAttribute(`.gutter [data-line="${badLine}"]`, 'class'), 'g-error');
  // The gutter's numbers sit beside their lines.
  const rows = await page.$$eval('.gutter [data-line]', (ds) => ds.map((d) => d.getBoundingClientRect().height));
  assert.ok(rows.every((hgt) => Math.abs(hgt - 18) < 0.5), `gutter rows are not one text line high: ${rows}`);
  assert.equal(await page.isDisabled('[data-testid=submit-run]'), true, 'a spec with errors can be submitted');

  // The fixed spec lints clean and is submitted from the page.
  const good = demoSpec('browser-demo').replace(/^description: .*$/m, 'description: "<script>window.__xss=2</script> tiny"');
  assert.ok(good.includes('<script>'), 'the demo has no description line: update this test');
  await page.fill('[data-testid=spec-input]', good);
  await page.waitForSelector('[data-testid=lint-status] [data-valid="true"]');
  assert.equal(await page.locator('[data-testid=diagnostic]').count(), 0);
  // The worker is paused while the run is submitted, so the page is sure to show it waiting
  // (and why) before it runs; it resumes once the page has shown that.
  const worker = procs.find((p) => p.name === 'worker').child;
  worker.kill('SIGSTOP');
  try {
    await page.click('[data-testid=submit-run]');
    await page.waitForURL(/\/runs\/\d+$/);
    await page.waitForSelector('[data-testid=dag] [data-step="download"][data-state="ready"]');
    await page.waitForFunction(() => /waiting for a worker to claim it/.test(document.querySelector('[data-task][data-name="download"]')?.textContent || ''));
    assert.match(await page.textContent('[data-task][data-name="split"]'), /waiting on step `shard`/);
  } finally {
    worker.kill('SIGCONT');
  }
  const runId = Number(new URL(page.url()).pathname.split('/').pop());
  assert.equal(await page.title(), `Run #${runId} · Shardline`);

  // It progresses and completes: every step of the graph turns succeeded; states are recorded
  // as they change (no reload).
  const seen = new Set();
  const navigations = [];
  page.on('framenavigated', (f) => { if (f === page.mainFrame()) navigations.push(f.url()); });
  await until('the run to succeed', async () => {
    const states = await page.$$eval('[data-testid=dag] [data-step]', (gs) => gs.map((g) => `${g.dataset.step}:${g.dataset.state}`));
    states.forEach((s) => seen.add(s));
    const header = await page.getAttribute('.titlebar[data-state]', 'data-state').catch(() => null);
    return header === 'succeeded' && states.length === 5 && states.every((s) => s.endsWith(':succeeded'));
  }, 120000);
  assert.equal(navigations.length, 0, `the page reloaded: ${navigations}`);
  // The changes came over the event stream (a fetch stream, since a token is set).
  const live = await page.evaluate(() => window.__shardline);
  assert.ok(live.events > 10 && live.stream === 'fetch', `events: ${JSON.stringify(live)}`);
  const steps = ['download', 'shard', 'split', 'validate', 'upload'];
  assert.deepEqual(await page.$$eval('[data-testid=dag] [data-step]', (gs) => gs.map((g) => g.dataset.step)), steps);
  assert.ok([...seen].some((s) => !s.endsWith(':succeeded')), `never saw the run in progress: ${[...seen]}`);
  // The shard step fans out into plan, 8 rank files and commit.
  assert.match(await page.textContent('[data-step="shard"]'), /10\/10 done/);
  assert.match(await page.textContent('[data-step="shard"]'), /fan-out ×10/);
  const table = page.locator('[data-testid=task-table]');
  assert.equal(await table.getAttribute('data-count'), '14');
  const rank = page.locator('[data-task][data-name="shard/rank-0"]');
  assert.equal(await rank.getAttribute('data-state'), 'succeeded');
  assert.equal(await rank.locator('[role=progressbar]').getAttribute('aria-valuenow'), '100');
  await page.screenshot({ path: SCREENSHOT, fullPage: true });
  assert.ok(readFileSync(SCREENSHOT).length > 10000, 'the screenshot is empty');

  // Who submitted it (the token's name), where the result went, a bar per task, every attempt.
  assert.equal(await page.textContent('[data-testid=submitted-by]'), 'token:browser-submit');
  const view = await (await fetch(`${base}/api/v1/runs/${runId}/view`)).json();
  const dest = await page.textContent('[data-testid=result-dest]');
  assert.ok(dest.startsWith(`file://${tmp}/out/browser-demo-`), `result destination ${dest}`);
  assert.equal(await page.$eval('[data-testid=result-dest]', (e) => e.tagName), 'SPAN', 'a file URL is text, not a link');
  assert.equal(await page.textContent('[data-testid=result-manifest]'), `${dest}/shardline-manifest.json`);
  const manifest = JSON.parse(readFileSync(join(new URL(dest).pathname, 'shardline-manifest.json'), 'utf8'));
  const published = manifest.files.reduce((n, f) => n + f.size, 0);
  assert.equal(await page.getAttribute('[data-testid=result-bytes]', 'data-bytes'), String(published));
  assert.match(await page.textContent('[data-testid=result-bytes]'), new RegExp(`\\(${published} bytes\\) in ${manifest.files.length} files`));
  assert.equal(await page.textContent('[data-testid=result-mesh]'), view.result.mesh);
  assert.match(view.result.mesh, /^tp2.*dp4/);
  assert.equal(await page.locator('[data-testid=timeline-task]').count(), 14, 'one bar per task');
  assert.deepEqual(await page.$$eval('[data-testid=timeline-step]', (rs) => rs.map((r) => r.dataset.step)), steps);
  // One evaluate for query and reading (`$$eval` queries, then evaluates: the live page can
  // replace the timeline in between, leaving detached rows with no box and no `.timeline`).
  const widths = await page.evaluate(() => [...document.querySelectorAll('[data-testid=timeline-task] .tl-bar')]
    .map((b) => b.getBoundingClientRect().width));
  assert.ok(widths.every((w) => w > 0), `bars without width: ${widths}`);
  // Task rows are not painted in their state's colour (a field report: grey labels on green):
  // only the bar is, and the label reads at WCAG AA contrast against the timeline's background.
  const tlRows = await page.evaluate(() => [...document.querySelectorAll('[data-testid=timeline-task]')].map((r) => {
    const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
    const lum = ([r, g, b]) => {
      const ch = (v) => { const s = v / 255; return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4; };
      return 0.2126 * ch(r) + 0.7152 * ch(g) + 0.0722 * ch(b);
    };
    const label = r.querySelector('.tl-label');
    const bg = getComputedStyle(r.closest('.timeline')).backgroundColor;
    const [l1, l2] = [lum(rgb(getComputedStyle(label).color)), lum(rgb(bg))].sort((a, b) => b - a);
    return { row: getComputedStyle(r).backgroundColor, label: getComputedStyle(label).backgroundColor,
             track: getComputedStyle(r.querySelector('.tl-track')).backgroundColor, contrast: (l1 + 0.05) / (l2 + 0.05) };
  }));
  for (const r of tlRows) {
    assert.equal(r.row, 'rgba(0, 0, 0, 0)', `a timeline row is painted: ${JSON.stringify(r)}`);
    assert.equal(r.label, 'rgba(0, 0, 0, 0)', `a timeline label is painted: ${JSON.stringify(r)}`);
    assert.ok(r.contrast >= 4.5, `timeline label contrast ${r.contrast.toFixed(2)} < 4.5`);
  }
  assert.deepEqual(await seriousViolations(page), [], 'the run page (timeline open) has serious accessibility violations');
  // Queried and read in one evaluate, as the widths above: a refresh between a query and the
  // read would leave detached bars, whose computed colour is empty.
  const bars = await page.evaluate(() => [...document.querySelectorAll('[data-testid=timeline-task] .tl-bar')]
    .map((b) => getComputedStyle(b).backgroundColor));
  assert.ok(bars.every((c) => c === 'rgb(23, 128, 61)'), `succeeded bars are green: ${bars}`);
  assert.ok((await page.textContent('[data-testid=run-attempts] thead')).includes('Kind'));
  assert.equal(await page.locator('[data-testid=run-attempt]').count(), 14);

  // A task's logs, from the store: its own lines, searchable.
  await page.click('[data-task][data-name="shard/rank-0"] a.task-link');
  await page.waitForSelector('[data-testid=task-panel]:not([hidden])');
  assert.equal(await page.textContent('[data-testid=task-name]'), 'shard/rank-0');
  await page.waitForFunction(() => document.querySelectorAll('[data-testid=logs] [data-line]').length >= 2);
  const logText = await page.textContent('[data-testid=logs]');
  assert.match(logText, /succeeded in/);
  await page.waitForFunction(() => /browser-worker/.test(document.querySelector('[data-testid=attempts]')?.textContent || ''));
  assert.deepEqual(await seriousViolations(page), [], 'the task panel');
  await page.fill('[data-testid=log-search]', 'succeeded in');
  await page.waitForFunction(() => /^1 of \d+ lines match$/.test(document.querySelector('[data-testid=log-count]').textContent));
  assert.equal(await page.locator('[data-testid=logs] [data-line]').count(), 1);

  // Another run waits for a GPU no worker has; the page says why, and an admin cancels it.
  const gpuSpec = demoSpec('browser-gpu').replace('resources: {cpus: 2, memory: 2GiB, scratch: 64MiB}', 'resources: {cpus: 2, memory: 2GiB, scratch: 64MiB, gpus: 1}');
  assert.ok(gpuSpec.includes('gpus: 1'), 'the demo shard step resources moved: update this test');
  // This one is uploaded as a file.
  const gpuFile = join(tmp, 'browser-gpu.yaml');
  writeFileSync(gpuFile, gpuSpec);
  await page.click('nav a[data-nav="submit"]');
  await page.setInputFiles('[data-testid=spec-file]', gpuFile);
  await page.waitForFunction((text) => document.querySelector('[data-testid=spec-input]').value === text, gpuSpec);
  assert.equal(await page.inputValue('[data-testid=spec-name]'), 'browser-gpu.yaml');
  await page.waitForSelector('[data-testid=lint-status] [data-valid="true"]');
  await page.click('[data-testid=submit-run]');
  await page.waitForURL(/\/runs\/\d+$/);
  const waitingUrl = page.url();
  const waitingId = Number(new URL(waitingUrl).pathname.split('/').pop());
  assert.notEqual(waitingId, runId);
  await page.waitForFunction(() => /no worker has enough resources: needs 1 GPUs/.test(document.querySelector('[data-task][data-name="shard"]')?.textContent || ''), null, { timeout: 60000 });
  assert.equal(await page.locator('[data-testid=cancel-run]').count(), 1);
  await setToken(page, adminToken);
  await page.goto(waitingUrl);
  await page.click('[data-testid=cancel-run]');
  await page.waitForSelector('.titlebar[data-state="cancelled"]');
  assert.equal(await page.locator('[data-testid=cancel-run]').count(), 0);
  // Retried, it waits again for the same reason; cancelled again.
  await page.click('[data-testid=retry-run]');
  await page.waitForSelector('.titlebar[data-state="queued"], .titlebar[data-state="running"]');
  await page.waitForFunction(() => /no worker has enough resources: needs 1 GPUs/.test(document.querySelector('[data-task][data-name="shard"]')?.textContent || ''));
  await page.click('[data-testid=cancel-run]');
  await page.waitForSelector('.titlebar[data-state="cancelled"]');
  assert.equal(await page.locator('[data-testid=retry-run]').count(), 1);
  // Each cancel and retry names the admin token that did it, in order.
  await page.waitForFunction(() => document.querySelectorAll('[data-testid=run-action]').length === 3);
  assert.deepEqual(await page.$$eval('[data-testid=run-action]', (ds) => ds.map((d) => `${d.dataset.action} ${d.querySelector('.actor').textContent}`)),
    ['cancel token:browser-admin', 'retry token:browser-admin', 'cancel token:browser-admin']);
  assert.equal(await page.textContent('[data-testid=submitted-by]'), 'token:browser-submit');

  // The runs page lists both with model and state, and filters by state.
  await page.click('nav a[data-nav="runs"]');
  await page.waitForSelector(`[data-testid=runs-table] tr[data-run="${waitingId}"]`);
  assert.match(await page.textContent(`tr[data-run="${runId}"]`), /succeeded/);
  assert.match(await page.textContent(`tr[data-run="${runId}"]`), /qwen3_next/);
  await page.selectOption('[data-testid=filter-state]', 'cancelled');
  await page.waitForURL(/\/runs\?state=cancelled$/);
  await page.waitForSelector(`[data-testid=runs-table] tr[data-run="${waitingId}"]`);
  assert.equal(await page.locator(`tr[data-run="${runId}"]`).count(), 0);
  assert.equal(await page.locator('[data-testid=runs-table] tbody tr').count(), 1);
  assert.deepEqual(await seriousViolations(page), [], 'the runs page');
  assert.deepEqual(await invisibleFocus(page, 12), [], 'keyboard focus must be visible on the runs page');

  // Workers and pipelines pages; the trigger with its next firing.
  await page.click('nav a[data-nav="workers"]');
  await page.waitForSelector('tr[data-worker="browser-worker"]');
  const now = new Date();
  const due = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate(), 2));
  if (due <= now) due.setUTCDate(due.getUTCDate() + 1);
  const listed = await until('the trigger to be registered with its next firing', async () => {
    const ts = await (await fetch(`${base}/api/v1/triggers`)).json();
    return ts.find((t) => t.pipeline === 'browser-nightly' && t.next_at);
  });
  assert.equal(new Date(listed.next_at).getTime(), due.getTime(), `next firing ${listed.next_at}`);
  await page.click('nav a[data-nav="pipelines"]');
  await page.click('details[data-pipeline="browser-nightly"] summary');
  const trigger = await page.waitForSelector('details[data-pipeline="browser-nightly"] [data-testid=triggers] tbody tr');
  const cells = await trigger.$$eval('td', (tds) => tds.map((td) => td.textContent));
  assert.match(cells[2], /0 2 \* \* \*/);
  assert.equal(cells[3], 'never');
  assert.deepEqual(await seriousViolations(page), [], 'the pipelines page, a pipeline open');
  assert.equal(cells[4], await page.evaluate((iso) => new Date(iso).toLocaleString(undefined, { hour12: false }), listed.next_at));
  await page.click('details[data-pipeline="browser-demo"] summary');
  await page.waitForFunction(() => document.querySelector('details[data-pipeline="browser-demo"] [data-testid=spec]')?.textContent.includes('megatron.shard'));
  assert.ok((await page.textContent('details[data-pipeline="browser-demo"] [data-testid=spec]')).includes('<script>window.__xss=2</script>'));
  assert.equal(await page.locator('details[data-pipeline="browser-demo"] script').count(), 0);
  assert.equal(await page.evaluate(() => window.__xss), undefined);

  await context.close();
  assert.deepEqual(problems, [], `console errors or failed requests:\n${problems.join('\n')}`);
});

test('a failing step shows its error attempts, its webhook delivery, and a registered pipeline starts from its params form', { timeout: 180000 }, async () => {
  // A webhook receiver that accepts every notification.
  const hooks = [];
  const receiver = createServer((req, res) => {
    let body = '';
    req.on('data', (c) => { body += c; });
    req.on('end', () => { hooks.push({ url: req.url, body }); res.writeHead(200); res.end('ok'); });
  });
  await new Promise((r) => receiver.listen(0, '127.0.0.1', r));
  servers.push(receiver);
  const hook = `http://127.0.0.1:${receiver.address().port}/hook`;
  // A download from a Hub whose files all fail, tried twice (each attempt fails on the error
  // budget); params of each type for the form.
  const hub = await slowHub('browser/slow-a', FIXTURE, 256 << 10, { failFiles: true });
  const spec = [
    'apiVersion: shardline/v1', 'kind: Pipeline', 'name: browser-failing',
    'params:', '  repo: {type: string, default: browser/slow-a}', `  scratch: {type: path, default: ${tmp}/scratch-a}`,
    '  flavor: {type: string, default: plain, enum: [plain, fancy]}', '  copies: {type: int, default: 1}',
    `notify: [{url: "${hook}"}]`, 'steps:',
    '  - id: download', '    uses: hf.download', `    with: {repo: "\${{ params.repo }}", endpoint: "${hub.endpoint}"}`,
    '    retry: {attempts: 2, backoff: 1s}', '',
  ].join('\n');
  const submitted = await fetch(`${base}/api/v1/runs`, {
    method: 'POST', headers: { Authorization: `Bearer ${submitToken}`, 'Content-Type': 'application/json' },
    body: JSON.stringify({ spec, file: 'failing.yaml' }),
  });
  const answer = await submitted.text();
  assert.equal(submitted.status, 201, answer);
  const { run: id } = JSON.parse(answer);

  const { context, page, problems } = await newPage();
  await page.goto(`${base}/`);
  await setToken(page, submitToken);
  await page.goto(`${base}/runs/${id}`);
  await page.waitForSelector('.titlebar[data-state="failed"]', { timeout: 90000 });
  // Both attempts failed on the error budget, shown with their kind.
  await page.waitForFunction(() => document.querySelectorAll('[data-testid=run-attempt][data-kind="error"]').length === 2);
  assert.deepEqual(await page.$$eval('[data-testid=run-attempt] [data-testid=attempt-kind]', (ds) => ds.map((d) => d.textContent)), ['error', 'error']);
  assert.ok((await page.textContent('[data-testid=run-attempts] thead')).includes('Kind'));
  assert.equal(await page.locator('[data-testid=timeline-task]').count(), 1);
  assert.equal(await page.locator('[data-testid=result]:not([hidden])').count(), 0, 'a failed run has no result');
  assert.deepEqual(await seriousViolations(page), [], 'a failed run');
  // The webhook was told, and the page shows the delivery.
  await page.waitForSelector('[data-testid=notifications] tr[data-state="delivered"]', { timeout: 60000 });
  const row = await page.textContent('[data-testid=notifications] tr[data-state="delivered"]');
  assert.ok(row.includes(`127.0.0.1:${receiver.address().port}/hook`) && row.includes('failed') && row.includes('HTTP 200'), row);
  assert.ok(hooks.some((h) => h.url === '/hook' && h.body.includes(String(id))), JSON.stringify(hooks));


  // The params form: the registered pipeline's params, typed and prefilled with their defaults;
  // started with two of them changed. The worker is paused meanwhile and the run cancelled
  // before it resumes: the run is only looked at, never worked on.
  await page.click('nav a[data-nav="submit"]');
  await page.waitForSelector('[data-testid=pipeline-select] option[value="browser-failing"]', { state: 'attached' });
  await page.selectOption('[data-testid=pipeline-select]', 'browser-failing');
  await page.waitForSelector('[data-testid=param-scratch]');
  assert.equal(await page.inputValue('[data-testid=param-scratch]'), `${tmp}/scratch-a`);
  assert.equal(await page.inputValue('[data-testid=param-repo]'), 'browser/slow-a');
  assert.equal(await page.$eval('[data-testid=param-flavor]', (e) => e.tagName), 'SELECT');
  assert.equal(await page.inputValue('[data-testid=param-flavor]'), 'plain');
  assert.equal(await page.getAttribute('[data-testid=param-copies]', 'type'), 'number');
  await page.fill('[data-testid=param-scratch]', `${tmp}/scratch-b`);
  await page.selectOption('[data-testid=param-flavor]', 'fancy');
  const worker = procs.find((p) => p.name === 'worker').child;
  worker.kill('SIGSTOP');
  try {
    await page.click('[data-testid=start-pipeline]');
    await page.waitForURL((u) => /\/runs\/\d+$/.test(u.pathname) && Number(u.pathname.split('/').pop()) !== id);
    const run = Number(new URL(page.url()).pathname.split('/').pop());
    const cancelled = await fetch(`${base}/api/v1/runs/${run}/cancel`, { method: 'POST', headers: { Authorization: `Bearer ${adminToken}` } });
    assert.equal(cancelled.status, 200);
  } finally {
    worker.kill('SIGCONT');
  }
  await page.waitForURL((u) => /\/runs\/\d+$/.test(u.pathname) && Number(u.pathname.split('/').pop()) !== id);
  const started = Number(new URL(page.url()).pathname.split('/').pop());
  const detail = await (await fetch(`${base}/api/v1/runs/${started}`)).json();
  assert.equal(detail.run.pipeline, 'browser-failing');
  assert.deepEqual(detail.run.params, { repo: 'browser/slow-a', scratch: `${tmp}/scratch-b`, flavor: 'fancy', copies: 1 });
  assert.equal(detail.run.submitted_by, 'token:browser-submit');
  await page.waitForSelector('[data-testid=submitted-by]');
  await page.waitForFunction(() => /token:browser-admin/.test(document.querySelector('[data-testid=run-action]')?.textContent || ''));
  await context.close();
  assert.deepEqual(problems, [], `console errors or failed requests:\n${problems.join('\n')}`);
});

test('a running task shows a progress bar with bytes/s and ETA, and its logs follow live', { timeout: 240000 }, async () => {
  // A release served by a Hub imitation at 2 MiB/s: its download spans several heartbeats
  // (every 0.67 s with this worker's 2 s lease) however fast the machine is.
  const release = join(tmp, 'synth-qwen3-moe');
  execFileSync(BIN, ['synth', '--arch', 'qwen3_moe', '--size', '16MB', release], { cwd: tmp, stdio: 'ignore' });
  const hub = await slowHub('browser/slow-moe', release, 2 << 20);
  const spec = [
    'apiVersion: shardline/v1', 'kind: Pipeline', 'name: browser-progress', 'steps:',
    '  - id: download', '    uses: hf.download', `    with: {repo: browser/slow-moe, endpoint: "${hub.endpoint}"}`,
    '  - id: shard', '    uses: megatron.shard', '    needs: [download]', '    with: {tp: 1, dp: 2}',
    '  - id: validate', '    uses: checkpoint.validate', '    needs: [shard]', '',
  ].join('\n');
  const file = join(tmp, 'progress.yaml');
  writeFileSync(file, spec);
  const id = Number(cli('submit', file).trim());
  assert.ok(id > 0);

  const { context, page, problems } = await newPage();
  await page.goto(`${base}/runs/${id}`);
  const row = '[data-task][data-name="download"]';
  // While the download runs, its row shows a partial bar, the rate and the time left.
  // One snapshot of the row per poll: waiting on an element that is not there yet (the bar
  // appears with the first heartbeat) would sleep through the download.
  const shown = await until('a live rate and ETA on the download task', async () => {
    const now = await page.evaluate((sel) => {
      const r = document.querySelector(sel);
      const bar = r?.querySelector('[role=progressbar]');
      return r && { state: r.dataset.state, text: r.querySelector('.progress')?.textContent || '', pct: bar ? Number(bar.getAttribute('aria-valuenow')) : NaN };
    }, row);
    if (now?.state === 'succeeded') throw new Error('the download finished before a heartbeat showed its progress');
    if (now?.state !== 'leased') return null;
    return /\/s/.test(now.text) && /ETA \d/.test(now.text) && now.pct > 0 && now.pct < 100 ? now : null;
  }, 60000);
  const totalMiB = hub.total / 2 ** 20;
  assert.match(shown.text, new RegExp(`MiB / ${Math.floor(totalMiB)}\\.\\d MiB`), `total ${totalMiB.toFixed(2)} MiB`);
  assert.match(await page.textContent(`${row} [role=cell]`), /download/);
  assert.deepEqual(await seriousViolations(page), [], 'a running run');
  // Its panel while it runs: the lease holder, then the last lines arriving without a reload.
  await page.click(`${row} a.task-link`);
  await page.waitForSelector('[data-testid=task-panel]:not([hidden])');
  await page.waitForFunction(() => /browser-worker/.test(document.querySelector('[data-testid=attempts]')?.textContent || ''));
  const before = await page.locator('[data-testid=logs] [data-line]').count();
  await page.waitForFunction(() => /succeeded in/.test(document.querySelector('[data-testid=logs]')?.textContent || ''), null, { timeout: 120000 });
  assert.ok(await page.locator('[data-testid=logs] [data-line]').count() > before, 'no log line arrived while following');
  await page.waitForSelector('.titlebar[data-state="succeeded"]', { timeout: 60000 });
  assert.equal(await page.getAttribute(`${row} [role=progressbar]`, 'aria-valuenow'), '100');
  assert.equal(await page.getAttribute('[data-task][data-name="validate"] [role=progressbar]', 'aria-valuenow'), '100');
  await context.close();
  assert.deepEqual(problems, [], `console errors or failed requests:\n${problems.join('\n')}`);
});

test('the run page of a run with 2,000 tasks renders in under a second', { timeout: 120000 }, async () => {
  // The demo at tp 2 × dp 997: download, plan, 1,994 rank files, commit, split, validate,
  // upload. Its shard step wants a GPU this worker lacks, so the run stays put while measured.
  const spec = demoSpec('browser-2000').replace('resources: {cpus: 2, memory: 2GiB, scratch: 64MiB}', 'resources: {cpus: 2, memory: 2GiB, scratch: 64MiB, gpus: 1}');
  const file = join(tmp, 'big.yaml');
  writeFileSync(file, spec);
  const { context, page, problems } = await newPage();
  // Submitted from elsewhere, the run appears on an open runs page by itself (the page reloads
  // its list on events; its own timer would take 10 s).
  await page.goto(`${base}/runs`);
  await page.waitForSelector('[data-testid=runs-table] tr[data-run]');
  const id = Number(cli('submit', file, '--set', 'tp=2', '--set', 'dp=997').trim());
  assert.ok(id > 0);
  await page.waitForSelector(`[data-testid=runs-table] tr[data-run="${id}"]`, { timeout: 5000 });
  const tasks = await (await fetch(`${base}/api/v1/runs/${id}/tasks`)).json();
  assert.equal(tasks.length, 2000);

  // Once to warm the server's and the browser's caches of the static files, then measured.
  await page.goto(`${base}/runs/${id}`);
  await page.waitForSelector('[data-testid=task-table][data-rendered-ms]');
  const figures = [];
  for (let i = 0; i < 3; i += 1) {
    const t0 = Date.now();
    await page.goto(`${base}/runs/${id}`);
    await page.waitForSelector('[data-testid=task-table][data-rendered-ms]');
    const wall = Date.now() - t0;
    const m = await page.evaluate(() => window.__shardline);
    assert.equal(m.runPageTasks, 2000);
    assert.equal(await page.locator('[data-testid=task-table] [role=row][data-task]').count(), 2000);
    const api = await page.evaluate(() => Object.fromEntries(performance.getEntriesByType('resource')
      .filter((e) => e.name.includes('/api/v1/runs/'))
      .map((e) => [new URL(e.name).pathname.split('/').slice(4).join('/') || 'run', Math.round(e.duration)])));
    figures.push({
      navigationToRenderedMs: Math.round(m.runPageRenderedMs),
      scriptStartMs: Math.round(m.runPageStartedMs),
      dataArrivedMs: Math.round(m.runPageDataMs),
      wallMs: wall,
      apiMs: api,
    });
  }
  const worst = Math.max(...figures.map((f) => f.navigationToRenderedMs));
  console.log(`run page with 2,000 tasks: navigation start to task table rendered ${figures.map((f) => `${f.navigationToRenderedMs} ms`).join(', ')} (wall ${figures.map((f) => `${f.wallMs} ms`).join(', ')}); worst ${worst} ms; script started / data arrived at ${figures.map((f) => `${f.scriptStartMs}/${f.dataArrivedMs} ms`).join(', ')}; API requests (ms): ${JSON.stringify(figures.map((f) => f.apiMs))}`);
  writeFileSync(join(OUT, 'run-page-2000.json'), JSON.stringify({ tasks: 2000, figures, worst }, null, 2));
  assert.ok(worst < 1000, `the run page took ${worst} ms to render 2,000 tasks`);
  assert.match(await page.textContent('[data-task][data-name="shard"]'), /no worker has enough resources/);
  await context.close();
  assert.deepEqual(problems, [], `console errors or failed requests:\n${problems.join('\n')}`);
});

test('the storage page shows the retention policy and what the worker\'s gc measured; a run page its disk use', { timeout: 60000 }, async () => {
  const runs = (await (await fetch(`${base}/api/v1/runs?pipeline=browser-demo`)).json()).runs;
  assert.ok(runs.length >= 1);
  const { context, page, problems } = await newPage();
  await page.goto(`${base}/storage`);
  await page.waitForFunction(() => /finished runs kept for ever; caches without limit/.test(document.querySelector('[data-testid=retention-policy]')?.textContent || ''));
  // The worker's first gc pass comes a few seconds after it starts; the page refreshes every 10 s.
  await page.waitForSelector('[data-testid=disk-reporters] tr[data-reporter]', { timeout: 30000 });
  const reporter = await page.getAttribute('[data-testid=disk-reporters] tr[data-reporter]', 'data-reporter');
  assert.ok(reporter.endsWith(`:${join(stateDir, 'work')}`), reporter);
  await page.waitForSelector('[data-testid=cache-usage] tr[data-cache]');
  assert.deepEqual(await seriousViolations(page), [], 'the storage page');
  await page.goto(`${base}/runs/${runs[0].id}`);
  await page.waitForSelector('[data-testid=run-disk]');
  assert.match(await page.textContent('[data-testid=run-disk]'), /\d( \w?i?B)/);
  await context.close();
  assert.deepEqual(problems, [], `console errors or failed requests:\n${problems.join('\n')}`);
});

test('logs stay readable after the worker is gone', { timeout: 60000 }, async () => {
  const worker = procs.find((p) => p.name === 'worker');
  worker.child.kill('SIGTERM');
  await until('the worker to exit', () => worker.child.exitCode !== null || worker.child.signalCode !== null);
  const runs = (await (await fetch(`${base}/api/v1/runs?pipeline=browser-demo`)).json()).runs;
  assert.equal(runs.length, 1);
  const tasks = await (await fetch(`${base}/api/v1/runs/${runs[0].id}/tasks?summary=true`)).json();
  const rank = tasks.find((t) => t.name === 'shard/rank-0');

  const { context, page, problems } = await newPage();
  await page.goto(`${base}/workers`);
  await page.waitForSelector('tr[data-worker="browser-worker"] [data-state="stopped"]');
  assert.deepEqual(await seriousViolations(page), [], 'the workers page');
  await page.goto(`${base}/runs/${runs[0].id}?task=${rank.id}`);
  await page.waitForSelector('[data-testid=task-panel]:not([hidden])');
  await page.waitForFunction(() => /succeeded in/.test(document.querySelector('[data-testid=logs]')?.textContent || ''));
  assert.match(await page.textContent('[data-testid=logs]'), /succeeded in/);
  await context.close();
  assert.deepEqual(problems, [], `console errors or failed requests:\n${problems.join('\n')}`);
});

test('by default every API request needs a token; a revoked one stops working at once', { timeout: 60000 }, async () => {
  const server = start('server-closed', ['server', '--http', '127.0.0.1:0']);
  const closed = await until('the second server to listen', () => {
    const m = readFileSync(server.log, 'utf8').match(/http:\/\/(127\.0\.0\.1:\d+)\//);
    return m ? `http://${m[1]}` : null;
  });
  const reader = cli('token', 'create', '--scope', 'read', '--name', 'browser-read').trim();
  const get = (path, token) => fetch(`${closed}${path}`, { headers: token ? { Authorization: `Bearer ${token}` } : {} });
  assert.equal((await get('/api/v1/runs')).status, 401);
  assert.equal((await get('/api/v1/runs', reader)).status, 200);
  const index = await get('/runs');
  assert.equal(index.status, 200, 'the dashboard itself holds no data and loads without a token');
  assert.match(index.headers.get('content-security-policy'), /script-src 'self'/);
  // A read token cannot cancel; the admin token can't after it is revoked.
  const runs = (await (await get('/api/v1/runs?state=cancelled', reader)).json()).runs;
  assert.ok(runs.length >= 1);
  const retry = (token) => fetch(`${closed}/api/v1/runs/${runs[0].id}/retry`, { method: 'POST', headers: { Authorization: `Bearer ${token}` } });
  assert.equal((await retry(reader)).status, 403);
  const id = cli('token', 'list').split('\n').find((l) => l.includes('browser-admin')).trim().split(/\s+/)[0];
  assert.match(cli('token', 'revoke', id), /revoked/);
  assert.equal((await retry(adminToken)).status, 401);
  assert.match(cli('token', 'list').split('\n').find((l) => l.includes('browser-admin')), /\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\s*$/);
});
