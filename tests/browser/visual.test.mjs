// Visual checks of the dashboard: screenshots of pages in fixed states (fixed clock, a fresh
// server with fixed data: one registered pipeline, no runs, no worker) compared with baselines/,
// in light and dark colour schemes and at 1400 and 1024 px; axe-core on the dark and narrow
// layouts too. Refresh the baselines on purpose with `npm run update-baselines`.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, mkdirSync, readFileSync, rmSync, openSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { seriousViolations } from './a11y.mjs';
import { screenshotDiff } from './visual.mjs';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.SHARDLINE_BIN || join(ROOT, 'target/debug/shardline');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const CLOCK = new Date('2026-01-15T12:00:00Z');

const tmp = mkdtempSync(join(tmpdir(), 'shardline-visual-'));
let server = null;
let base = '';
let browser = null;

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
  const end = Date.now() + 30000;
  while (!base && Date.now() < end) {
    const m = readFileSync(log, 'utf8').match(/http:\/\/(127\.0\.0\.1:\d+)\//);
    if (m) base = `http://${m[1]}`;
    else await new Promise((r) => setTimeout(r, 100));
  }
  assert.ok(base, `the server did not start:\n${readFileSync(log, 'utf8')}`);
  browser = await chromium.launch({ executablePath: CHROMIUM, headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--font-render-hinting=none', '--disable-lcd-text'] });
});

after(async () => {
  if (browser) await browser.close();
  if (server && server.exitCode === null) {
    server.kill('SIGTERM');
    await new Promise((r) => { server.once('exit', r); setTimeout(r, 10000); });
  }
  rmSync(tmp, { recursive: true, force: true });
});

/** `path` opened at the fixed clock in a `width` x 900 viewport and `scheme`, once shown. */
async function open(path, { width = 1400, scheme = 'light' } = {}) {
  const context = await browser.newContext({ viewport: { width, height: 900 }, colorScheme: scheme, reducedMotion: 'reduce' });
  const page = await context.newPage();
  await page.clock.setFixedTime(CLOCK);
  await page.goto(`${base}${path}`);
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

test('dashboard pages match their baselines (light, dark, 1024 px) and pass axe-core', { timeout: 120000 }, async () => {
  const failures = [];
  for (const [name, path, opts] of PAGES) {
    const { context, page } = await open(path, opts);
    try {
      // Creation times and durations come from the server's clock, not the page's, a run's facts
      // name the machine's user, and a spec hash changes with the canonical form of specs (a
      // new step field, say), not with how the page looks: masked.
      const diff = await screenshotDiff(page, name, [page.locator('table.grid td:nth-child(7), table.grid td:nth-child(8), .meta dd, time, [data-time], [data-spec-hash]')]);
      if (diff) failures.push(diff);
      for (const v of await seriousViolations(page)) failures.push(`${name}: ${v}`);
    } finally {
      await context.close();
    }
  }
  assert.deepEqual(failures, []);
});
