// Pipelines: each stored pipeline's newest spec, and its triggers with their last and next
// firing when the server has triggers.

import { get } from '../api.js';
import { h, replace, link, errorBox } from '../dom.js';
import { time } from '../format.js';

export function render(view) {
  const list = h('div', { 'data-testid': 'pipelines' });
  replace(view, h('h1', {}, 'Pipelines'), list);
  let stopped = false;
  (async () => {
    try {
      const [ps, triggers] = await Promise.all([get('/pipelines'), get('/triggers').catch(() => null)]);
      if (stopped) return;
      // Pipelines with a stored spec, then those only a trigger names (not submitted yet).
      const names = ps.map((p) => p.name);
      for (const t of triggers || []) if (!names.includes(t.pipeline)) names.push(t.pipeline);
      if (!names.length) {
        replace(list, h('p', { class: 'muted' }, 'No pipeline has been submitted yet. ', link('/submit', 'Submit one.')));
        return;
      }
      replace(list, names.map((name) => {
        const p = ps.find((x) => x.name === name);
        const spec = p ? h('pre', { class: 'spec', 'data-testid': 'spec' }, 'Loading…') : h('p', { class: 'muted' }, 'No run submitted yet: the spec is stored with the first run.');
        const mine = (triggers || []).filter((t) => t.pipeline === name);
        const details = h('details', { 'data-pipeline': name },
          h('summary', {}, h('strong', {}, name), ' ',
            p ? h('span', { class: 'muted' }, `${p.versions} version${p.versions === 1 ? '' : 's'} · spec `,
              h('span', { 'data-spec-hash': '' }, p.latest_spec_hash.slice(0, 12))) : null, ' ',
            mine.length ? h('span', { class: 'muted' }, `· ${mine.length} trigger${mine.length === 1 ? '' : 's'}`) : null),
          // Outside the summary: a control inside another is unreachable to assistive technology.
          h('p', { class: 'small' }, link(`/runs?pipeline=${encodeURIComponent(name)}`, `runs of ${name}`)),
          triggers ? triggerTable(mine) : null,
          spec);
        details.addEventListener('toggle', async () => {
          if (!p || !details.open || spec.dataset.loaded) return;
          try {
            const d = await get(`/pipelines/${encodeURIComponent(name)}`);
            spec.textContent = d.spec_text;
            spec.dataset.loaded = '1';
          } catch (e) {
            replace(spec, errorBox(e));
          }
        });
        return details;
      }));
    } catch (e) {
      if (!stopped) replace(list, errorBox(e));
    }
  })();
  return () => { stopped = true; };
}

function triggerTable(ts) {
  if (!ts.length) return h('p', { class: 'muted' }, 'No triggers.');
  return h('table', { class: 'grid', 'data-testid': 'triggers' },
    h('thead', {}, h('tr', {}, ['#', 'Kind', 'Trigger', 'Last fired', 'Next', 'Last run', 'Last check'].map((c) => h('th', {}, c)))),
    h('tbody', {}, ts.map((t) => h('tr', { 'data-trigger': t.id },
      h('td', {}, String(t.position)),
      h('td', {}, t.kind),
      h('td', { class: 'mono' }, t.summary),
      h('td', {}, t.last_fired_at ? time(t.last_fired_at) : 'never'),
      h('td', {}, time(t.next_at)),
      h('td', {}, t.last_run ? link(`/runs/${t.last_run}`, `#${t.last_run}`) : ''),
      h('td', { class: t.errors ? 'bad' : 'muted' },
        t.errors ? `${t.errors} failed in a row: ${t.last_error || ''}` : (t.last_check_at ? `ok, ${time(t.last_check_at)}` : ''))))));
}
