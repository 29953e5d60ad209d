// Runs: newest first, filtered by state and pipeline, a page at a time (keyset paging on the
// run id, so the thousandth page costs what the first does).

import { get } from '../api.js';
import { h, replace, link, badge, errorBox } from '../dom.js';
import { duration, ago } from '../format.js';
import { subscribe } from '../live.js';
import { navigate } from '../app.js';

const STATES = ['', 'queued', 'running', 'succeeded', 'failed', 'cancelled'];
const PAGE = 50;

export function render(view, _m, params) {
  const state = params.get('state') || '';
  const pipeline = params.get('pipeline') || '';
  const before = params.get('before') || '';
  // Cursors of the pages before this one, for "Newer".
  const trail = (params.get('trail') || '').split(',').filter(Boolean);

  const go = (next) => {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(next)) if (v) q.set(k, v);
    const qs = q.toString();
    navigate(`/runs${qs ? `?${qs}` : ''}`);
  };

  const stateSel = h('select', { 'data-testid': 'filter-state', 'aria-label': 'filter runs by state', onchange: () => go({ state: stateSel.value, pipeline }) },
    STATES.map((s) => h('option', { value: s, selected: s === state }, s || 'any state')));
  const pipeSel = h('select', { 'data-testid': 'filter-pipeline', 'aria-label': 'filter runs by pipeline', onchange: () => go({ state, pipeline: pipeSel.value }) },
    h('option', { value: '' }, 'any pipeline'));
  if (pipeline) pipeSel.append(h('option', { value: pipeline, selected: true }, pipeline));
  get('/pipelines').then((ps) => {
    for (const p of ps) {
      if (p.name !== pipeline) pipeSel.append(h('option', { value: p.name }, p.name));
    }
  }).catch(() => {});

  const body = h('tbody');
  const table = h('table', { class: 'grid', 'data-testid': 'runs-table' },
    h('thead', {}, h('tr', {}, ['Run', 'Pipeline', 'Model', 'Revision', 'State', 'Tasks', 'Duration', 'Created'].map((c) => h('th', {}, c)))),
    body);
  const pager = h('div', { class: 'pager' });
  const status = h('div');
  replace(view,
    h('div', { class: 'titlebar' }, h('h1', {}, 'Runs'), h('div', { class: 'filters' }, stateSel, pipeSel)),
    status, table, pager);

  let timer = null;
  let stopped = false;
  async function load() {
    const q = new URLSearchParams({ limit: String(PAGE) });
    if (state) q.set('state', state);
    if (pipeline) q.set('pipeline', pipeline);
    if (before) q.set('before', before);
    try {
      const page = await get(`/runs?${q}`);
      if (stopped) return;
      replace(status);
      replace(body, page.runs.map(row));
      if (!page.runs.length) body.append(h('tr', {}, h('td', { colspan: 8, class: 'muted' }, 'No runs.')));
      const buttons = [];
      if (before) {
        const back = trail[trail.length - 1] || '0';
        buttons.push(h('button', { 'data-testid': 'newer', onclick: () => go({ state, pipeline, before: back === '0' ? '' : back, trail: trail.slice(0, -1).join(',') }) }, '← Newer'));
      }
      if (page.next) {
        buttons.push(h('button', { 'data-testid': 'older', onclick: () => go({ state, pipeline, before: String(page.next), trail: [...trail, before || '0'].join(',') }) }, 'Older →'));
      }
      replace(pager, buttons);
    } catch (e) {
      if (!stopped) replace(status, errorBox(e));
    }
  }

  function row(r) {
    const done = r.tasks.succeeded;
    return h('tr', { 'data-run': r.id },
      h('td', {}, link(`/runs/${r.id}`, `#${r.id}`)),
      h('td', {}, r.pipeline),
      h('td', { class: 'mono' }, r.model || ''),
      h('td', { class: 'mono' }, r.revision || ''),
      h('td', {}, badge(r.state)),
      h('td', {}, `${done}/${r.tasks.total}`, r.tasks.failed ? h('span', { class: 'bad' }, ` (${r.tasks.failed} failed)`) : ''),
      h('td', {}, duration(r.duration_ms)),
      h('td', { title: r.created_at }, ago(r.created_at)));
  }

  // At most one reload per 500 ms however fast events come.
  const unsub = subscribe((ev) => {
    if (ev.kind !== 'run' && ev.state !== 'succeeded') return;
    if (timer) return;
    timer = setTimeout(() => { timer = null; load(); }, 500);
  });
  const tick = setInterval(load, 10000);
  load();
  return () => { stopped = true; unsub(); clearTimeout(timer); clearInterval(tick); };
}
