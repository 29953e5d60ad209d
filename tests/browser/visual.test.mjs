// Visual checks of the dashboard: screenshots of pages in fixed states (fixed clock, a fresh
// server with fixed data: one registered pipeline, no runs, no worker) compared with baselines/,
// in light and dark colour schemes and at 1400 and 1024 px; axe-core on the dark and narrow
// layouts too. A second server, with a real worker, holds runs in states only a worker makes:
// succeeded, failed (a download of a missing release), a wide fan-out that failed before it ran,
// and running (a download from a Hub imitation that stalls on one file); its pages are checked
// the same way, and so is the submit page with lint errors shown.
// Refresh the baselines on purpose with `npm run update-baselines`.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { cpSync, existsSync, mkdtempSync, mkdirSync, readFileSync, rmSync, openSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { seriousViolations } from './a11y.mjs';
import { screenshotDiff } from './visual.mjs';
import { hubImitation } from './hub.mjs';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.SHARDLINE_BIN || join(ROOT, 'target/debug/shardline');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const CLOCK = new Date('2026-01-15T12:00:00Z');
const FIXTURE = join(ROOT, 'tests/fixtures/hf-tiny/qwen3_next');
// The file of the release the stuck Hub never sends: the running download stops at the others.
const STALLED = 'model-00001-of-00004.safetensors';

const tmp = mkdtempSync(join(tmpdir(), 'shardline-visual-'));
let server = null;
let base = '';
let browser = null;
// The second server, its worker and the Hub imitation.
const wstate = join(tmp, 'state-w');
let wserver = null;
let worker = null;
let hub = null;
let wbase = '';

function cleanEnv() {
  // Workers keep nothing of the disk free (see dashboard.test.mjs).
  const env = { ...process.env, HF_HOME: join(tmp, 'hf-home'), SHARDLINE_SCRATCH_RESERVE: '0' };
  for (const k of ['SHARDLINE_DATABASE_URL', 'HF_HUB_CACHE', 'HF_ENDPOINT', 'HF_TOKEN']) delete env[k];
  return env;
}

/** The http://host:port a server printed to `log`, once it did. */
async function listening(log) {
  const end = Date.now() + 30000;
  while (Date.now() < end) {
    const m = readFileSync(log, 'utf8').match(/http:\/\/(127\.0\.0\.1:\d+)\//);
    if (m) return `http://${m[1]}`;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail(`the server did not start:\n${readFileSync(log, 'utf8')}`);
}

async function until(what, fn, timeoutMs = 30000) {
  const end = Date.now() + timeoutMs;
  let last;
  while (Date.now() < end) {
    last = await fn().catch((e) => e);
    if (last === true) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  const logs = ['worker.log', 'server-w.log'].map((f) => `--- ${f} ---\n${readFileSync(join(tmp, f), 'utf8').slice(-3000)}`).join('\n');
  assert.fail(`timed out waiting for ${what} (last: ${last})\n${logs}`);
}

/** A pipeline of a download (its `with:` map), tried once, and a shard of it on `mesh`. */
function downloadAndShard(name, download, mesh = '{tp: 1, dp: 2}') {
  return ['apiVersion: shardline/v1', 'kind: Pipeline', `name: ${name}`, 'steps:',
    '  - id: download', '    uses: hf.download', `    with: ${download}`, '    retry: {attempts: 1}',
    '  - id: shard', '    uses: megatron.shard', '    needs: [download]', `    with: ${mesh}`, ''].join('\n');
}

before(async () => {
  assert.ok(existsSync(BIN), `${BIN} is missing: build it first (cargo build --bin shardline)`);
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: run scripts/setup-browser`);
  const pipelines = join(tmp, 'pipelines');
  mkdirSync(pipelines, { recursive: true });
  writeFileSync(join(pipelines, 'nightly.yaml'), readFileSync(join(ROOT, 'pipelines/demo.yaml'), 'utf8')
    .replace(/^name: demo$/m, 'name: visual-nightly'));
  const env = { ...process.env };
  delete env.SHARDLINE_DATABASE_URL;
  // Fixed data: run #1 queued (no worker takes it), run #2 cancelled.
  const cli = (...a) => execFileSync(BIN, [...a, '--state-dir', join(tmp, 'state')], { cwd: tmp, encoding: 'utf8', env }).trim();
  const spec = join(tmp, 'visual.yaml');
  writeFileSync(spec, readFileSync(join(ROOT, 'pipelines/demo.yaml'), 'utf8').replace(/^name: demo$/m, 'name: visual'));
  assert.equal(cli('submit', spec), '1');
  assert.equal(cli('submit', spec), '2');
  cli('cancel', '2');
  const log = join(tmp, 'server.log');
  server = spawn(BIN, ['server', '--http', '127.0.0.1:0', '--public-reads', '--pipelines', pipelines, '--state-dir', join(tmp, 'state')],
    { cwd: tmp, stdio: ['ignore', openSync(log, 'w'), openSync(log, 'a')], env });

  // The second server's runs, submitted before its worker starts (their ids are fixed): #1
  // succeeds (a step cache entry for the storage page), #2 fails (the release is missing), #3
  // fails the same way before its 202 shard tasks run (the timeline folds them), #4 runs until
  // the test ends (its download stalls on one file). The worker takes its tasks while the first
  // test looks at the first server.
  assert.ok(existsSync(join(FIXTURE, 'config.json')), `${FIXTURE} is missing`);
  // Read from the directory runs are submitted from: the model's name is the path as written.
  cpSync(FIXTURE, join(tmp, 'qwen3_next'), { recursive: true });
  hub = await hubImitation('visual/stuck', FIXTURE, { stalled: STALLED });
  const wcli = (...a) => execFileSync(BIN, [...a, '--state-dir', wstate], { cwd: tmp, encoding: 'utf8', env: cleanEnv() }).trim();
  const specs = [
    downloadAndShard('visual-small', '{path: qwen3_next}'),
    downloadAndShard('visual-failing', '{path: /nonexistent/visual/release}'),
    downloadAndShard('visual-fanout', '{path: /nonexistent/visual/release}', '{tp: 2, dp: 100}'),
    downloadAndShard('visual-running', `{repo: visual/stuck, endpoint: "${hub.endpoint}"}`),
  ];
  specs.forEach((spec, i) => {
    const file = join(tmp, `w${i + 1}.yaml`);
    writeFileSync(file, spec);
    assert.equal(wcli('submit', file), String(i + 1));
  });
  const wlog = join(tmp, 'server-w.log');
  wserver = spawn(BIN, ['server', '--http', '127.0.0.1:0', '--public-reads', '--retain-runs', '30d', '--cache-max', '10GiB', '--state-dir', wstate],
    { cwd: tmp, stdio: ['ignore', openSync(wlog, 'w'), openSync(wlog, 'a')], env: cleanEnv() });
  // Its own gc is off: the storage page shows one measurement, taken once the runs are set.
  const klog = join(tmp, 'worker.log');
  worker = spawn(BIN, ['worker', '--name', 'visual-worker', '--cpus', '4', '--memory', '8GiB', '--lease-seconds', '2', '--no-gc', '--state-dir', wstate],
    { cwd: tmp, stdio: ['ignore', openSync(klog, 'w'), openSync(klog, 'a')], env: cleanEnv() });
  base = await listening(log);
  wbase = await listening(wlog);
  browser = await chromium.launch({ executablePath: CHROMIUM, headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--font-render-hinting=none', '--disable-lcd-text'] });
});

after(async () => {
  if (browser) await browser.close();
  // The stalled download fails once the Hub imitation drops its connections, so the worker
  // drains at once.
  if (hub) {
    hub.server.closeAllConnections();
    hub.server.close();
  }
  const stops = [server, wserver, worker].filter((p) => p && p.exitCode === null && p.signalCode === null).map((p) => {
    p.kill('SIGTERM');
    return new Promise((r) => { p.once('exit', r); setTimeout(() => { if (p.exitCode === null) p.kill('SIGKILL'); r(); }, 10000); });
  });
  await Promise.all(stops);
  rmSync(tmp, { recursive: true, force: true });
});

/** `path` of the server at `at` opened at the fixed clock in a `width` x 900 viewport and
 *  `scheme` (after `setup`), once shown. */
async function open(path, { width = 1400, scheme = 'light', at = base, setup = null } = {}) {
  const context = await browser.newContext({ viewport: { width, height: 900 }, colorScheme: scheme, reducedMotion: 'reduce' });
  const page = await context.newPage();
  await page.clock.setFixedTime(CLOCK);
  if (setup) await setup(page);
  await page.goto(`${at}${path}`);
  await page.waitForFunction(() => document.getElementById('live')?.textContent === 'live');
  await page.waitForFunction(() => document.querySelector('main')?.textContent.trim().length > 0);
  await page.evaluate(() => document.fonts.ready);
  await page.waitForTimeout(300);
  return { context, page };
}

const PAGES = [
  ['runs', '/runs', {}], ['workers', '/workers', {}], ['pipelines', '/pipelines', {}],
  ['submit', '/submit', {}], ['token', '/token', {}],
  ['run', '/runs/1', {}], ['run-cancelled', '/runs/2', {}],
  ['runs-dark', '/runs', { scheme: 'dark' }], ['runs-1024', '/runs', { width: 1024 }],
  ['run-dark', '/runs/1', { scheme: 'dark' }], ['run-1024', '/runs/1', { width: 1024 }],
  ['pipelines-dark', '/pipelines', { scheme: 'dark' }], ['pipelines-1024', '/pipelines', { width: 1024 }],
];

// Creation times and durations come from the server's clock, not the page's, a run's facts
// name the machine's user, and a spec hash changes with the canonical form of specs (a new step
// field, say), not with how the page looks: masked.
const MASK = 'table.grid td:nth-child(7), table.grid td:nth-child(8), .meta dd, time, [data-time], [data-spec-hash]';
// The worker's states mask only what varies there, so that their errors, attempts and task facts
// are compared: times and durations (a run's or task's, its attempts', its log lines', the
// timeline's start and length), the submitter (the machine's user), a running download's rate
// and ETA, and the host and temporary paths of the storage page and of a result. (Ages show
// "just now": the page's clock is fixed before the server's.)
const WORKER_MASK = [
  ...['Created', 'Duration', 'Submitted by', 'Finished'].map((k) => `.meta dt:text-is("${k}") + dd`),
  '[data-testid=attempts] td:nth-child(3), [data-testid=attempts] td:nth-child(4)',
  '[data-testid=run-attempts] td:nth-child(4), [data-testid=run-attempts] td:nth-child(5)',
  'pre.logs .ts, .timeline > .small:first-child, .tgrid [data-state=leased] .progress .small',
  '[data-testid=disk-reporters] td.mono, [data-testid=cache-usage] td.mono, [data-testid=result-dest]',
].join(', ');

/** Failures of `page` against baselines/`name`.png (`mask` hidden) and axe-core. */
async function check(page, name, mask) {
  const diff = await screenshotDiff(page, name, [page.locator(mask)]);
  return [...(diff ? [diff] : []), ...(await seriousViolations(page)).map((v) => `${name}: ${v}`)];
}

test('dashboard pages match their baselines (light, dark, 1024 px) and pass axe-core', { timeout: 120000 }, async () => {
  const failures = [];
  for (const [name, path, opts] of PAGES) {
    const { context, page } = await open(path, opts);
    try {
      failures.push(...await check(page, name, MASK));
    } finally {
      await context.close();
    }
  }
  assert.deepEqual(failures, []);
});

/** The second server's run `id` as its API gives it. */
async function view(id) {
  return (await fetch(`${wbase}/api/v1/runs/${id}/view`)).json();
}

// A spec with one lint error (an unknown step kind, with a note and a hint).
const BROKEN = readFileSync(join(ROOT, 'pipelines/demo.yaml'), 'utf8').replace(/^name: demo$/m, 'name: visual-broken')
  .replace('uses: megatron.split_fused', 'uses: megatron.split_fuzed');

/** Once the run page names the worker of its download task (the worker list loads apart). */
async function workerNamed(page) {
  await page.waitForFunction(() => /visual-worker/.test(document.querySelector('[data-task][data-name="download"]')?.textContent || ''));
}

/** The storage page's data with the host part of each state directory's name (the host's name,
 *  `<host>:<work directory>`) the same everywhere: masked, its length would still change the
 *  widths of the table's columns from one machine to the next. */
async function sameHost(page) {
  await page.route('**/api/v1/storage', async (route) => {
    const st = await (await route.fetch()).json();
    const host = (r) => r.replace(/^[^:]*:/, 'host:');
    for (const r of st.reporters) r.reporter = host(r.reporter);
    for (const c of st.caches) c.reporter = host(c.reporter);
    await route.fulfill({ json: st });
  });
}

// [name, server, path, what to wait for or do before the screenshot, what else to mask, setup]
const WORKER_STATES = [
  ['submit-lint', () => base, '/submit', async (page) => {
    await page.fill('[data-testid=spec-input]', BROKEN);
    await page.waitForSelector('[data-testid=lint-status] [data-valid="false"]');
    await page.waitForSelector('[data-testid=diagnostic][data-code]');
    // The editor from its first line, unfocused, and the diagnostics under it in view.
    await page.$eval('[data-testid=spec-input]', (t) => { t.blur(); t.scrollTop = 0; });
    await page.waitForFunction(() => document.querySelector('.gutter').scrollTop === 0);
    await page.$eval('.editor', (e) => e.scrollIntoView({ block: 'start' }));
  }],
  ['run-running', () => wbase, '/runs/4', async (page) => {
    await page.waitForSelector(`[data-task][data-name="download"][data-state="leased"] [role=progressbar][aria-valuenow="${Math.round((hub.done / hub.total) * 100)}"]`);
    await workerNamed(page);
  }],
  ['run-succeeded', () => wbase, '/runs/1', async (page) => {
    await page.waitForSelector('.titlebar[data-state="succeeded"]');
    await page.waitForSelector('[data-testid=run-disk]');
    await workerNamed(page);
  }, '.timeline .tl-track'], // its bars' lengths are the tasks' durations
  ['run-failed', () => wbase, '/runs/2', async (page) => {
    await page.waitForSelector('.titlebar[data-state="failed"]');
    await page.waitForSelector('[data-testid=run-attempt][data-kind="error"]');
    await workerNamed(page);
  }],
  ['task', () => wbase, '/runs/2', async (page) => {
    await page.click('[data-task][data-name="download"] a.task-link');
    await page.waitForSelector('[data-testid=task-panel]:not([hidden])');
    await page.waitForFunction(() => /cannot open release directory/.test(document.querySelector('[data-testid=logs]')?.textContent || '')
      && /visual-worker/.test(document.querySelector('[data-testid=attempts]')?.textContent || ''));
    await workerNamed(page);
    await page.$eval('[data-testid=task-panel]', (p) => p.scrollIntoView({ block: 'start' }));
  }],
  ['run-steps-open', () => wbase, '/runs/3', async (page) => {
    await page.click('[data-testid=timeline] details.tl-more summary');
    await page.waitForFunction(() => document.querySelectorAll('[data-testid=timeline] details[open] [data-testid=timeline-task]').length === 202);
    // Every task row above is laid out once first: a row not yet scrolled to counts at an
    // estimated height, which would move the timeline by a fraction of a pixel depending on
    // which rows were.
    await page.evaluate(async () => {
      const frames = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
      for (let y = 0; y < document.documentElement.scrollHeight; y += window.innerHeight / 2) {
        window.scrollTo(0, y);
        await frames();
      }
    });
    await page.$eval('[data-testid=timeline]', (t) => t.scrollIntoView({ block: 'start' }));
  }],
  ['storage', () => wbase, '/storage', async (page) => {
    await page.waitForSelector('[data-testid=disk-reporters] tr[data-reporter]');
    await page.waitForSelector('[data-testid=cache-usage] tr[data-cache]');
  }, null, sameHost],
];

test('a worker\'s states (succeeded, running, failed, a task, steps open, storage) and lint errors match their baselines and pass axe-core', { timeout: 90000 }, async () => {
  // The runs in their states: #1 succeeded, #2 and #3 failed, #4's download done but for the
  // stalled file (its bytes as of the heartbeat after the last complete file).
  await until('the worker\'s runs to reach their states', async () => {
    const [v1, v2, v3, v4] = await Promise.all([1, 2, 3, 4].map(view));
    const dl = v4.tasks.find((t) => t.name === 'download');
    return v1.run.state === 'succeeded' && v2.run.state === 'failed' && v3.run.state === 'failed'
      && dl.state === 'leased' && dl.progress_info?.bytes === hub.done;
  }, 60000);
  // One gc measurement of the state directory, for the storage page.
  execFileSync(BIN, ['gc', '--state-dir', wstate], { cwd: tmp, env: cleanEnv(), stdio: 'ignore' });
  const failures = [];
  for (const [name, at, path, prepare, mask, setup] of WORKER_STATES) {
    const { context, page } = await open(path, { at: at(), setup });
    try {
      await prepare(page);
      failures.push(...await check(page, name, mask ? `${WORKER_MASK}, ${mask}` : WORKER_MASK));
    } finally {
      await context.close();
    }
  }
  assert.deepEqual(failures, []);
});
