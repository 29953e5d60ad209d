// A task's panel: state, why it waits, resources, retry budgets, attempts (lease owner,
// heartbeat age, which budget each drew on, errors) and its logs — read from the store, so they
// stay after the worker is gone — followed live and searchable.

import { get } from '../api.js';
import { h, replace, badge, errorBox } from '../dom.js';
import { bytes, ago, time } from '../format.js';

const TERMINAL = new Set(['succeeded', 'failed', 'cancelled']);
// Which retry budget an ended attempt drew on.
const KIND_TITLES = {
  error: 'the task failed or timed out: counted against retry.attempts',
  lost: 'the worker was lost (its lease expired): counted against retry.lost',
};

export function taskPanel(panel, runId, task, onClose) {
  let stopped = false;
  let after = 0;
  let following = true;
  const lines = [];
  const summary = h('div');
  const attemptsBody = h('tbody');
  const logBox = h('pre', { class: 'logs', 'data-testid': 'logs', tabindex: 0 });
  const search = h('input', { type: 'search', placeholder: 'search logs', 'data-testid': 'log-search' });
  const follow = h('input', { type: 'checkbox', checked: true, 'data-testid': 'log-follow' });
  const count = h('span', { class: 'muted small', 'data-testid': 'log-count' });

  replace(panel,
    h('div', { class: 'titlebar' },
      h('h2', {}, 'Task ', h('span', { class: 'mono', 'data-testid': 'task-name' }, task.name)),
      h('button', { onclick: onClose, 'data-testid': 'close-task' }, 'Close')),
    summary,
    h('h3', {}, 'Attempts'),
    h('table', { class: 'grid', 'data-testid': 'attempts' },
      h('thead', {}, h('tr', {}, ['#', 'Worker', 'Started', 'Ended', 'Outcome', 'Kind', 'Error'].map((c) => h('th', {}, c)))),
      attemptsBody),
    h('div', { class: 'titlebar' }, h('h3', {}, 'Logs ', count),
      h('div', { class: 'filters' }, search, h('label', {}, follow, ' follow'))),
    logBox);

  function renderSummary(t) {
    const r = t.resources;
    const item = (k, v) => (v ? [h('dt', {}, k), h('dd', {}, v)] : []);
    replace(summary, h('dl', { class: 'meta' },
      item('State', badge(t.state)),
      item('Why', t.reason),
      item('Error', t.error),
      item('Step', `${t.step_id} (${t.kind})`),
      item('Retries', `${t.attempts_used} of ${t.max_attempts} attempts, ${t.lost} of ${t.max_lost} lost leases`),
      item('Needs', `${r.cpus} CPUs, ${bytes(r.memory)} memory, ${r.gpus} GPUs, ${bytes(r.scratch)} scratch`),
      item('Lease', t.state === 'leased' ? `worker ${t.lease_owner}, since ${time(t.leased_at)}, expires ${time(t.lease_expires_at)}` : ''),
      item('Heartbeat', t.heartbeat_at ? ago(t.heartbeat_at) : ''),
      item('Finished', time(t.finished_at))));
  }

  async function loadAttempts() {
    try {
      const [t, atts] = await Promise.all([get(`/tasks/${task.id}`), get(`/tasks/${task.id}/attempts`)]);
      if (stopped) return;
      task = t;
      renderSummary(t);
      replace(attemptsBody, atts.map((a) => h('tr', {},
        h('td', {}, String(a.attempt)),
        h('td', {}, a.worker_name),
        h('td', {}, time(a.started_at)),
        h('td', {}, a.ended_at ? time(a.ended_at) : (t.heartbeat_at ? `running, beat ${ago(t.heartbeat_at)}` : 'running')),
        h('td', {}, a.outcome ? badge(a.outcome) : ''),
        h('td', { 'data-kind': a.kind || '', title: KIND_TITLES[a.kind] || '' }, a.kind || ''),
        h('td', { class: 'bad' }, a.error || ''))));
      if (!atts.length) attemptsBody.append(h('tr', {}, h('td', { colspan: 7, class: 'muted' }, 'Not started yet.')));
    } catch (e) {
      if (!stopped) replace(summary, errorBox(e));
    }
  }

  function renderLogs() {
    const needle = search.value.trim().toLowerCase();
    const shown = needle ? lines.filter((l) => l.line.toLowerCase().includes(needle)) : lines;
    const frag = document.createDocumentFragment();
    for (const l of shown) {
      frag.append(h('div', { class: `log st-${l.stream}`, 'data-line': l.id },
        h('span', { class: 'ts' }, new Date(l.ts).toISOString().slice(11, 23)), ' ',
        h('span', { class: 'att' }, `#${l.attempt}`), ' ', l.line));
    }
    logBox.replaceChildren(frag);
    if (!shown.length) logBox.append(h('div', { class: 'muted' }, needle ? 'No line matches.' : 'No output yet.'));
    count.textContent = needle ? `${shown.length} of ${lines.length} lines match` : `${lines.length} lines`;
    if (following && !needle) logBox.scrollTop = logBox.scrollHeight;
  }

  async function readLogs() {
    try {
      for (let i = 0; i < 50; i += 1) {
        const page = await get(`/runs/${runId}/logs?task=${task.id}&after=${after}&limit=1000`);
        if (stopped) return;
        lines.push(...page.lines);
        after = page.next_after;
        if (!page.more) break;
      }
      renderLogs();
    } catch (e) {
      if (!stopped) replace(logBox, errorBox(e));
    }
  }

  search.addEventListener('input', renderLogs);
  follow.addEventListener('change', () => { following = follow.checked; });

  // Follow while the task can still write; once it has ended, one more read gets its last lines.
  let ended = 0;
  const tick = setInterval(async () => {
    if (!following || stopped) return;
    await readLogs();
    if (!TERMINAL.has(task.state)) {
      loadAttempts();
    } else if ((ended += 1) > 2) {
      clearInterval(tick);
    }
  }, 1000);
  loadAttempts();
  readLogs();
  panel.scrollIntoView({ block: 'nearest' });
  return () => { stopped = true; clearInterval(tick); };
}
