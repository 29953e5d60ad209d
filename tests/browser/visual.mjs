// Visual checks: a screenshot compared with a committed baseline PNG (baselines/) by pixelmatch,
// with a small tolerance. UPDATE_BASELINES=1 (npm run update-baselines) rewrites the baselines
// on purpose; a missing baseline fails. On failure the actual and diff images are written under
// artifacts/ (gitignored, where CI collects them) and their paths are printed.

import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import pixelmatch from 'pixelmatch';
import { PNG } from 'pngjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const BASELINES = join(HERE, 'baselines');
const ARTIFACTS = join(HERE, 'artifacts');
// pixelmatch already ignores anti-aliased pixels; a few more may differ (font rendering), while
// one recoloured state badge changes hundreds.
const MAX_DIFF_PIXELS = 40;

/** Compares a screenshot of `page` (time-dependent parts masked by `mask` locators) with
 *  baselines/<name>.png; returns a description of the difference, or null when it matches. */
export async function screenshotDiff(page, name, mask = []) {
  const shot = await page.screenshot({ fullPage: false, animations: 'disabled', caret: 'hide', mask, maskColor: '#ff00ff' });
  const file = join(BASELINES, `${name}.png`);
  if (process.env.UPDATE_BASELINES === '1') {
    mkdirSync(BASELINES, { recursive: true });
    writeFileSync(file, shot);
    return null;
  }
  if (!existsSync(file)) return `${file} is missing: run npm run update-baselines`;
  const want = PNG.sync.read(readFileSync(file));
  const got = PNG.sync.read(shot);
  mkdirSync(ARTIFACTS, { recursive: true });
  if (want.width !== got.width || want.height !== got.height) {
    writeFileSync(join(ARTIFACTS, `${name}.actual.png`), shot);
    return `${name}: size ${got.width}x${got.height}, baseline ${want.width}x${want.height} (actual: ${join(ARTIFACTS, `${name}.actual.png`)})`;
  }
  const diff = new PNG({ width: want.width, height: want.height });
  const n = pixelmatch(want.data, got.data, diff.data, want.width, want.height, { threshold: 0.05 });
  if (n <= MAX_DIFF_PIXELS) return null;
  const diffFile = join(ARTIFACTS, `${name}.diff.png`);
  writeFileSync(diffFile, PNG.sync.write(diff));
  writeFileSync(join(ARTIFACTS, `${name}.actual.png`), shot);
  console.log(`visual diff: ${diffFile}`);
  return `${name}: ${n} pixels differ from ${file} (diff image: ${diffFile})`;
}
