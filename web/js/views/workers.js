// Workers: resources, GPUs, what their current leases use, their disks, and how long since each last beat.

import { get } from '../api.js';
import { h, replace, link, badge, errorBox } from '../dom.js';
import { bytes, ago } from '../format.js';
import { subscribe } from '../live.js';

export function render(view) {
  const body = h('tbody');
  const status = h('div');
  replace(view, h('h1', {}, 'Workers'), status,
    h('table', { class: 'grid', 'data-testid': 'workers-table' },
      h('thead', {}, h('tr', {}, ['Worker', 'State', 'CPUs', 'Memory', 'GPUs', 'Scratch', 'Leases', 'Last heartbeat'].map((c) => h('th', {}, c)))),
      body));
  let stopped = false;
  async function load() {
    try {
      const ws = await get('/workers');
      if (stopped) return;
      replace(status);
      replace(body, ws.map((w) => {
        const r = w.resources, u = w.used;
        const stale = w.state === 'active' && w.heartbeat_age_s > 120;
        return h('tr', { 'data-worker': w.name },
          h('td', {}, w.name),
          h('td', {}, badge(stale ? 'silent' : w.state)),
          h('td', {}, `${u.cpus} / ${r.cpus}`),
          h('td', {}, `${bytes(u.memory)} / ${bytes(r.memory)}`),
          h('td', {}, w.gpus.length ? `${u.gpus} / ${r.gpus} (devices ${w.gpus.join(', ')})` : 'none'),
          h('td', {}, scratch(w)),
          h('td', {}, w.leases.length ? w.leases.map((l) => h('div', {}, link(`/runs/${l.run}?task=${l.task}`, `#${l.run} ${l.name}`))) : h('span', { class: 'muted' }, 'idle')),
          h('td', { title: w.last_heartbeat }, ago(w.last_heartbeat)));
      }));
      if (!ws.length) body.append(h('tr', {}, h('td', { colspan: 8, class: 'muted' }, 'No worker has registered. Start one with `shardline worker`.')));
    } catch (e) {
      if (!stopped) replace(status, errorBox(e));
    }
  }
  const unsub = subscribe(() => {});
  const tick = setInterval(load, 2000);
  load();
  return () => { stopped = true; clearInterval(tick); unsub(); };
}

// Scratch: what its leases hold, and, once it has measured its disk, what it offers to claims
// (the disk's free space less its reserve and its leases) and the disk itself.
function scratch(w) {
  const r = w.resources, u = w.used, d = w.disk;
  const cap = r.scratch > 2 ** 60 ? 'unlimited' : bytes(r.scratch);
  if (!d) return `${bytes(u.scratch)} / ${cap}`;
  return `${bytes(u.scratch)} used, ${bytes(d.scratch_free)} free (disk ${bytes(d.free)} free of ${bytes(d.total)})`;
}
