// Accessibility checks of dashboard pages with axe-core (the npm package), injected through the
// DevTools protocol (`page.evaluate`), which the pages' Content-Security-Policy does not govern.
// What fails: any violation of impact `serious` or `critical` (colour contrast included).

import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';

const AXE = readFileSync(createRequire(import.meta.url).resolve('axe-core/axe.min.js'), 'utf8');

/** The serious and critical violations on `page` as it is now, one line each. */
export async function seriousViolations(page) {
  if (!(await page.evaluate(() => typeof window.axe === 'object'))) await page.evaluate(AXE);
  const violations = await page.evaluate(async () => {
    const r = await window.axe.run(document, { resultTypes: ['violations'] });
    return r.violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help,
      nodes: v.nodes.slice(0, 3).map((n) => `${n.target.join(' ')}: ${n.failureSummary.split('\n').slice(1).join(' ')}`) }));
  });
  return violations
    .filter((v) => v.impact === 'serious' || v.impact === 'critical')
    .map((v) => `${v.id} (${v.impact}): ${v.help} — ${v.nodes.join(' | ')}`);
}

/** Tabs through the first `stops` focusable elements from the top of the page; each must show
 *  its focus (an outline, or a ring on the editor around it). Returns what does not. */
export async function invisibleFocus(page, stops) {
  // Sequential navigation starts from what was focused last: start it from the body.
  await page.evaluate(() => {
    document.body.tabIndex = -1;
    document.body.focus();
    document.body.removeAttribute('tabindex');
  });
  const hidden = [];
  for (let i = 0; i < stops; i += 1) {
    await page.keyboard.press('Tab');
    const f = await page.evaluate(() => {
      const e = document.activeElement;
      if (!e || e === document.body) return null;
      const s = getComputedStyle(e);
      const ring = e.closest('.editor') ? getComputedStyle(e.closest('.editor')).boxShadow : 'none';
      const shown = (s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) >= 1) || ring !== 'none';
      return { what: `${e.tagName.toLowerCase()}${e.dataset.testid ? `[data-testid=${e.dataset.testid}]` : ''} ${e.textContent.trim().slice(0, 30)}`, shown };
    });
    if (f && !f.shown) hidden.push(f.what);
  }
  return hidden;
}
