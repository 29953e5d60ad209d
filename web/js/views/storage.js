// Storage: the retention policy the server recorded, what each state directory's gc last
// measured (runs, step caches, downloads), and the largest step cache entries and downloads.

import { get } from '../api.js';
import { h, replace, errorBox } from '../dom.js';
import { bytes, ago } from '../format.js';

function policyText(r) {
  const runs = r.retain_runs ? `finished runs kept ${r.retain_runs}` : 'finished runs kept for ever';
  const cache = r.cache_max === null || r.cache_max === undefined ? 'caches without limit' : `caches up to ${bytes(r.cache_max)} per state directory`;
  return `${runs}; ${cache}`;
}

export function render(view) {
  const status = h('div');
  const policy = h('p', { 'data-testid': 'retention-policy' });
  const reporters = h('tbody');
  const caches = h('tbody');
  replace(view, h('h1', {}, 'Storage'), status, policy,
    h('h2', {}, 'State directories'),
    h('table', { class: 'grid', 'data-testid': 'disk-reporters' },
      h('thead', {}, h('tr', {}, ['Host:work directory', 'Runs', 'Step caches', 'Downloads', 'Measured'].map((c) => h('th', {}, c)))),
      reporters),
    h('h2', {}, 'Caches'),
    h('table', { class: 'grid', 'data-testid': 'cache-usage' },
      h('thead', {}, h('tr', {}, ['Directory', 'Kind', 'Size', 'Last used', 'Where'].map((c) => h('th', {}, c)))),
      caches));
  let stopped = false;
  async function load() {
    try {
      const st = await get('/storage');
      if (stopped) return;
      replace(status);
      replace(policy, policyText(st.retention));
      replace(reporters, st.reporters.map((r) => h('tr', { 'data-reporter': r.reporter },
        h('td', { class: 'mono' }, r.reporter),
        h('td', {}, bytes(r.run_bytes)),
        h('td', {}, bytes(r.cache_bytes)),
        h('td', {}, bytes(r.download_bytes)),
        h('td', { title: r.measured_at }, ago(r.measured_at)))));
      if (!st.reporters.length) {
        reporters.append(h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No gc has measured a state directory yet (workers do every --gc-every; or run `shardline gc`).')));
      }
      replace(caches, st.caches.map((c) => h('tr', { 'data-cache': c.path },
        h('td', { class: 'mono', title: c.cache_key || '' }, c.path),
        h('td', {}, c.kind),
        h('td', {}, bytes(c.bytes)),
        h('td', { title: c.last_used_at || '' }, ago(c.last_used_at)),
        h('td', { class: 'mono' }, c.reporter))));
      if (!st.caches.length) caches.append(h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No step cache entry or download measured.')));
    } catch (e) {
      if (!stopped) replace(status, errorBox(e));
    }
  }
  const tick = setInterval(load, 10000);
  load();
  return () => { stopped = true; clearInterval(tick); };
}
