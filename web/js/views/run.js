// A run: header and actions, who submitted, cancelled and retried it, where its result went,
// the step graph with each step's state and fan-out, the task table
// with progress bars (bytes/s, ETA) and why each task waits, a task's attempts and logs, and
// the webhooks told about the run's end (targets redacted by the server), a timeline of steps
// and tasks, every attempt with its kind, and the disk its work directory uses.

import { get, api } from '../api.js';
import { h, s, replace, link, badge, errorBox } from '../dom.js';
import { bytes, rate, eta, duration, ago, time } from '../format.js';
import { subscribe } from '../live.js';
import { navigate } from '../app.js';
import { taskPanel } from './task.js';
import { auditItems, renderResult, renderTimeline, renderAttempts } from './run-outcome.js';

const TERMINAL = new Set(['succeeded', 'failed', 'cancelled']);

export function render(view, [idText], params) {
  const id = Number(idText);
  const started = performance.now();
  const selected = params.get('task') ? Number(params.get('task')) : null;

  const header = h('div', { class: 'titlebar' });
  const meta = h('dl', { class: 'meta' });
  const message = h('div');
  // Focusable and named: on a narrow screen the graph scrolls sideways, by keyboard too.
  const dag = h('div', { class: 'dag', 'data-testid': 'dag', tabindex: '0', role: 'region', 'aria-label': 'Step graph' });
  const filterText = h('input', { type: 'search', placeholder: 'filter tasks by name', 'aria-label': 'filter tasks by name', 'data-testid': 'task-filter' });
  const filterState = h('select', { 'data-testid': 'task-state-filter', 'aria-label': 'filter tasks by state' },
    ['', 'blocked', 'ready', 'leased', 'succeeded', 'failed', 'cancelled'].map((v) => h('option', { value: v }, v || 'any state')));
  // A grid of rows rather than a <table>: rows off screen skip style and layout
  // (content-visibility), which keeps a run of thousands of tasks quick to show.
  const tbody = h('div', { role: 'rowgroup', class: 'tbody' });
  const table = h('div', { class: 'tgrid', role: 'table', 'aria-label': 'tasks', 'data-testid': 'task-table' },
    h('div', { role: 'rowgroup' }, h('div', { class: 'trow thead', role: 'row' },
      ['Task', 'Step', 'State', 'Attempt', 'Worker', 'Progress', 'Why / error'].map((c) => h('div', { role: 'columnheader' }, c)))),
    tbody);
  const panel = h('section', { class: 'panel', 'data-testid': 'task-panel', hidden: true });
  const notifyBody = h('tbody');
  const notifySection = h('section', { 'data-testid': 'notifications', hidden: true },
    h('h2', {}, 'Notifications'),
    h('table', { class: 'grid' },
      h('thead', {}, h('tr', {}, ['Target', 'Event', 'Format', 'State', 'Attempts', 'Last answer', 'Last attempt'].map((c) => h('th', {}, c)))),
      notifyBody));
  const resultBody = h('div');
  const resultSection = h('section', { 'data-testid': 'result', hidden: true }, h('h2', {}, 'Result'), resultBody);
  const timelineBody = h('div', { class: 'timeline' });
  const timelineSection = h('section', { 'data-testid': 'timeline', hidden: true }, h('h2', {}, 'Timeline'), timelineBody);
  const attemptsBody = h('tbody');
  const attemptsSection = h('section', { 'data-testid': 'run-attempts', hidden: true },
    h('h2', {}, 'Attempts'),
    h('table', { class: 'grid' },
      h('thead', {}, h('tr', {}, ['Task', '#', 'Worker', 'Started', 'Ended', 'Outcome', 'Kind', 'Error'].map((c) => h('th', {}, c)))),
      attemptsBody));
  replace(view, header, message, meta, resultSection, notifySection, h('h2', {}, 'Steps'), dag,
    h('div', { class: 'titlebar' }, h('h2', {}, 'Tasks'), h('div', { class: 'filters' }, filterText, filterState)),
    table, panel, timelineSection, attemptsSection);

  let stopped = false;
  let run = null;
  let tasks = [];
  let workers = new Map();
  const rows = new Map(); // task id -> { tr, key }
  let firstRender = true;
  let closePanel = null;
  let notificationsPending = false;

  function actions() {
    const out = [];
    if (run && !TERMINAL.has(run.state)) {
      out.push(h('button', { class: 'danger', 'data-testid': 'cancel-run', onclick: () => act('cancel') }, 'Cancel run'));
    }
    if (run && (run.state === 'failed' || run.state === 'cancelled')) {
      out.push(h('button', { 'data-testid': 'retry-run', onclick: () => act('retry') }, 'Retry'));
    }
    return out;
  }

  async function act(what) {
    if (what === 'cancel' && !confirm(`Cancel run #${id}?`)) return;
    try {
      await api(`/runs/${id}/${what}`, { method: 'POST', body: {} });
      replace(message, h('div', { class: 'note' }, what === 'cancel' ? 'Run cancelled.' : 'Run re-queued.'));
      schedule(0);
    } catch (e) {
      replace(message, errorBox(e));
    }
  }

  function renderHeader(diskBytes) {
    replace(header,
      h('h1', {}, `Run #${run.id} `, h('span', { class: 'muted' }, run.pipeline), ' ', badge(run.state)),
      h('div', { class: 'actions' }, actions()));
    header.dataset.state = run.state;
    const item = (k, v) => (v ? [h('dt', {}, k), h('dd', {}, v)] : []);
    replace(meta,
      item('Model', run.model), item('Revision', run.revision),
      item('Tasks', `${run.tasks.succeeded}/${run.tasks.total} succeeded` + (run.tasks.failed ? `, ${run.tasks.failed} failed` : '')),
      item('Created', time(run.created_at)), item('Duration', duration(run.duration_ms)),
      item('Dedupe key', run.dedupe_key),
      // What its work directory holds, as the workers' gc last measured it.
      diskBytes === null || diskBytes === undefined ? [] : [h('dt', {}, 'Disk'), h('dd', { 'data-testid': 'run-disk' }, bytes(diskBytes))],
      auditItems(run),
      run.error ? [h('dt', {}, 'Error'), h('dd', { class: 'bad', 'data-testid': 'run-error' }, run.error)] : []);
  }

  function renderNotifications(list) {
    notifySection.hidden = list.length === 0;
    notificationsPending = list.some((n) => n.state === 'pending');
    replace(notifyBody, list.map((n) => h('tr', { 'data-notification': n.id, 'data-state': n.state },
      h('td', { class: 'mono' }, n.target),
      h('td', {}, n.event),
      h('td', {}, n.format),
      h('td', {}, badge(n.state)),
      h('td', {}, String(n.attempts)),
      h('td', { class: n.state === 'failed' ? 'bad' : '' },
        [n.last_status ? `HTTP ${n.last_status}` : '', n.last_error && n.state !== 'delivered' ? n.last_error : ''].filter(Boolean).join(' · ')),
      h('td', {}, n.last_attempt_at ? ago(n.last_attempt_at) : (n.next_at ? 'due' : '')))));
  }

  function renderDag(steps) {
    const depth = new Map();
    const byId = new Map(steps.map((st) => [st.id, st]));
    const level = (st, seen = new Set()) => {
      if (depth.has(st.id)) return depth.get(st.id);
      if (seen.has(st.id)) return 0;
      seen.add(st.id);
      let d = 0;
      for (const n of st.needs) if (byId.has(n)) d = Math.max(d, level(byId.get(n), seen) + 1);
      depth.set(st.id, d);
      return d;
    };
    steps.forEach((st) => level(st));
    const cols = [];
    for (const st of steps) (cols[depth.get(st.id)] ||= []).push(st);
    const W = 220, H = 70, GX = 40, GY = 14;
    const pos = new Map();
    cols.forEach((col, c) => col.forEach((st, r) => pos.set(st.id, { x: 8 + c * (W + GX), y: 8 + r * (H + GY) })));
    const width = 16 + cols.length * (W + GX) - GX;
    const height = 16 + Math.max(1, ...cols.map((c) => c.length)) * (H + GY) - GY;
    const svg = s('svg', { width, height, viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': 'step graph' });
    for (const st of steps) {
      const to = pos.get(st.id);
      for (const n of st.needs) {
        const from = pos.get(n);
        if (!from) continue;
        const x1 = from.x + W, y1 = from.y + H / 2, x2 = to.x, y2 = to.y + H / 2;
        svg.append(s('path', { class: 'edge', d: `M${x1},${y1} C${x1 + GX / 2},${y1} ${x2 - GX / 2},${y2} ${x2},${y2}` }));
      }
    }
    for (const st of steps) {
      const p = pos.get(st.id);
      const t = st.tasks;
      const counts = `${t.succeeded}/${t.total} done` + (t.leased ? ` · ${t.leased} running` : '') + (t.failed ? ` · ${t.failed} failed` : '');
      const extra = (t.total > 1 ? `fan-out ×${t.total}` : '1 task') + (st.cached ? ` · ${st.cached} cached` : '') +
        (st.total_bytes ? ` · ${bytes(st.bytes)} / ${bytes(st.total_bytes)}` : st.bytes ? ` · ${bytes(st.bytes)}` : '');
      const g = s('g', { class: `node st-${st.state}`, 'data-step': st.id, 'data-state': st.state, transform: `translate(${p.x},${p.y})` },
        s('title', {}, `${st.id} (${st.kind}): ${st.state}`),
        s('rect', { width: W, height: H, rx: 6 }),
        s('text', { x: 10, y: 18, class: 'step-id' }, st.id),
        s('text', { x: W - 10, y: 18, class: 'step-state', 'text-anchor': 'end' }, st.state),
        s('text', { x: 10, y: 36, class: 'step-kind' }, st.kind),
        s('text', { x: 10, y: 52, class: 'step-counts' }, counts),
        s('text', { x: 10, y: 65, class: 'step-extra' }, extra));
      if (st.total_bytes) {
        const f = Math.min(1, st.bytes / st.total_bytes);
        g.append(s('rect', { class: 'step-bar', x: 0, y: H - 3, width: Math.round(W * f), height: 3 }));
      }
      svg.append(g);
    }
    replace(dag, svg);
  }

  function progressCell(t) {
    const p = t.progress_info;
    if (!p) return '';
    const frac = p.fraction ?? (t.state === 'succeeded' ? 1 : null);
    const bar = frac === null ? null : h('div', { class: 'bar', role: 'progressbar', 'aria-label': `progress of ${t.name}`, 'aria-valuenow': Math.round(frac * 100), 'aria-valuemin': 0, 'aria-valuemax': 100 },
      h('div', { class: 'fill', style: { width: `${(frac * 100).toFixed(1)}%` } }));
    const text = [bytes(p.bytes) + (p.total_bytes ? ` / ${bytes(p.total_bytes)}` : ''), rate(p.bytes_per_sec), eta(p.eta_seconds)].filter(Boolean).join(' · ');
    return [bar, h('div', { class: 'small' }, text)];
  }

  function rowFor(t) {
    const owner = t.lease_owner ? (workers.get(t.lease_owner) || `worker ${t.lease_owner}`) : '';
    const beat = t.state === 'leased' && t.heartbeat_at ? ` (beat ${ago(t.heartbeat_at)})` : '';
    return h('div', { role: 'row', 'data-task': t.id, 'data-name': t.name, 'data-state': t.state, class: t.id === selected ? 'trow selected' : 'trow' },
      h('div', { role: 'cell' }, h('a', { href: `/runs/${id}?task=${t.id}`, 'data-link': true, class: 'task-link' }, t.name)),
      h('div', { role: 'cell' }, t.step_id),
      h('div', { role: 'cell' }, badge(t.state)),
      h('div', { role: 'cell', title: 'attempts used of retry.attempts; lost leases of retry.lost' },
        `${t.attempts_used}/${t.max_attempts}`, t.lost ? h('span', { class: 'muted small' }, ` · ${t.lost}/${t.max_lost} lost`) : ''),
      h('div', { role: 'cell' }, owner, beat),
      h('div', { role: 'cell', class: 'progress' }, progressCell(t)),
      h('div', { role: 'cell', class: t.error ? 'bad' : 'muted' }, t.error || t.reason || ''));
  }

  function renderTasks() {
    const needle = filterText.value.trim().toLowerCase();
    const st = filterState.value;
    const frag = document.createDocumentFragment();
    let shown = 0;
    const seen = new Set();
    for (const t of tasks) {
      seen.add(t.id);
      const key = `${t.state}|${t.attempt}|${t.lease_owner}|${t.heartbeat_at}|${JSON.stringify(t.progress_info)}|${t.reason}|${t.error}|${workers.get(t.lease_owner)}`;
      let entry = rows.get(t.id);
      if (!entry || entry.key !== key) {
        entry = { tr: rowFor(t), key };
        rows.set(t.id, entry);
      }
      const visible = (!needle || t.name.toLowerCase().includes(needle)) && (!st || t.state === st);
      entry.tr.hidden = !visible;
      if (visible) shown += 1;
      frag.append(entry.tr);
    }
    for (const k of rows.keys()) if (!seen.has(k)) rows.delete(k);
    tbody.replaceChildren(frag);
    table.dataset.count = String(tasks.length);
    table.dataset.shown = String(shown);
  }
  filterText.addEventListener('input', renderTasks);
  filterState.addEventListener('change', renderTasks);

  // One refresh at a time; changes meanwhile ask for one more after it (events can arrive
  // faster than a 2,000-task run can be read).
  let inFlight = false;
  let again = false;
  let timer = null;
  function schedule(delay = 250) {
    if (timer) return;
    timer = setTimeout(() => { timer = null; refresh(); }, delay);
  }

  async function refresh() {
    if (inFlight) { again = true; return; }
    inFlight = true;
    try {
      const v = await get(`/runs/${id}/view`);
      if (stopped) return;
      const fetched = performance.now();
      run = v.run;
      tasks = v.tasks;
      renderHeader(v.disk_bytes);
      renderNotifications(v.notifications || []);
      renderDag(v.steps);
      renderTasks();
      renderResult(resultSection, resultBody, v.result);
      renderTimeline(timelineSection, timelineBody, v.timeline || { steps: [] });
      renderAttempts(attemptsSection, attemptsBody, v.attempts || [], new Map(tasks.map((t) => [t.id, t.name])));
      if (firstRender) {
        firstRender = false;
        // Measured after the frame that shows the table has been laid out.
        requestAnimationFrame(() => setTimeout(() => {
          const ms = performance.now();
          table.dataset.renderedMs = String(Math.round(ms));
          window.__shardline = {
            ...(window.__shardline || {}),
            runPageRenderedMs: ms, // since navigation start
            runPageDataMs: fetched, // when the run, graph and tasks had arrived
            runPageStartedMs: started, // when this page's script began
            runPageTasks: tasks.length,
          };
        }, 0));
      }
      if (selected && !closePanel) openPanel(selected);
    } catch (e) {
      if (!stopped) replace(message, errorBox(e));
    } finally {
      inFlight = false;
      if (again && !stopped) { again = false; schedule(); }
    }
  }

  function openPanel(taskId) {
    const t = tasks.find((x) => x.id === taskId);
    if (!t) return;
    panel.hidden = false;
    closePanel = taskPanel(panel, id, t, () => navigate(`/runs/${id}`));
  }

  get('/workers').then((ws) => {
    workers = new Map(ws.map((w) => [w.id, w.name]));
    if (!firstRender) renderTasks();
  }).catch(() => {});

  const unsub = subscribe((ev) => {
    if (ev.run === id) schedule();
  });
  // Heartbeats (progress) and deliveries are not events: poll while the run is live or a
  // notification of its end is still being sent.
  const poll = setInterval(() => { if (run && (!TERMINAL.has(run.state) || notificationsPending)) schedule(0); }, 2000);
  refresh();
  return () => {
    stopped = true;
    unsub();
    clearTimeout(timer);
    clearInterval(poll);
    if (closePanel) closePanel();
  };
}
