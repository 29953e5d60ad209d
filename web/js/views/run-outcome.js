// Parts of a run's page beside its graph and tasks: who submitted, cancelled and retried it;
// where its result went (a link only for http(s) destinations); a timeline of its steps and
// tasks as bars positioned through CSSOM (no style attributes, so the CSP holds); and every
// attempt with the retry budget it drew on.

import { h, replace, badge } from '../dom.js';
import { bytes, duration, time, ago } from '../format.js';

// Above this many tasks, a step's task bars are drawn only when the step is opened.
const TASK_BARS_LIMIT = 200;
// Above this many attempts, only those that did not simply succeed are listed.
const ATTEMPT_ROWS_LIMIT = 200;

const ACTION_WORDS = { cancel: 'Cancelled by', retry: 'Retried by' };

/** The audit entries of a run's meta list: submitter, then each cancel and retry. */
export function auditItems(run) {
  const out = [];
  if (run.submitted_by) {
    out.push(h('dt', {}, 'Submitted by'), h('dd', { class: 'mono', 'data-testid': 'submitted-by' }, run.submitted_by));
  }
  for (const a of run.actions || []) {
    out.push(h('dt', {}, ACTION_WORDS[a.action] || a.action),
      h('dd', { 'data-testid': 'run-action', 'data-action': a.action },
        h('span', { class: 'mono actor' }, a.actor), h('span', { class: 'muted' }, ` · ${time(a.at)}`)));
  }
  return out;
}

function isWebUrl(text) {
  try {
    const u = new URL(text);
    return u.protocol === 'http:' || u.protocol === 'https:';
  } catch {
    return false;
  }
}

/** A destination: a link for http(s), else text. */
function place(text, testid) {
  if (!text) return '';
  return isWebUrl(text)
    ? h('a', { href: text, rel: 'noopener noreferrer', target: '_blank', class: 'mono', 'data-testid': testid }, text)
    : h('span', { class: 'mono', 'data-testid': testid }, text);
}

/** The Result section's content; hidden while there is none. */
export function renderResult(section, body, result) {
  section.hidden = !result;
  if (!result) return;
  const item = (k, v) => (v ? [h('dt', {}, k), h('dd', {}, v)] : []);
  replace(body, h('dl', { class: 'meta' },
    item(result.published ? 'Published to' : 'Written to', place(result.dest, 'result-dest')),
    item('Manifest', place(result.manifest, 'result-manifest')),
    item('Mesh', result.mesh ? h('span', { class: 'mono', 'data-testid': 'result-mesh' }, result.mesh) : ''),
    item('Size', result.bytes !== null && result.bytes !== undefined
      ? h('span', { 'data-testid': 'result-bytes', 'data-bytes': result.bytes }, `${bytes(result.bytes)} (${result.bytes} bytes)`
        + (result.files ? ` in ${result.files} file${result.files === 1 ? '' : 's'}` : ''))
      : ''),
    item('Step', result.step)));
}

function bar(span, t0, total, cls) {
  const el = h('div', { class: `tl-bar ${cls}` });
  if (!span.start) { el.classList.add('tl-none'); return el; }
  const from = new Date(span.start).getTime() - t0;
  const to = (span.end ? new Date(span.end).getTime() : t0 + total) - t0;
  // CSSOM, not a style attribute: allowed under `style-src 'self'`.
  el.style.marginLeft = `${((from / total) * 100).toFixed(2)}%`;
  el.style.width = `${Math.max(0.5, ((to - from) / total) * 100).toFixed(2)}%`;
  el.title = `${time(span.start)} → ${span.end ? time(span.end) : 'running'} (${duration(to - from)})`;
  return el;
}

/** The timeline: a row per step, and under it a row per task, each a bar from start to end. */
export function renderTimeline(section, body, timeline) {
  const steps = timeline.steps || [];
  section.hidden = !timeline.start;
  if (!timeline.start) return;
  const t0 = new Date(timeline.start).getTime();
  const total = Math.max(1, new Date(timeline.end).getTime() - t0);
  const many = steps.reduce((n, s) => n + s.tasks.length, 0) > TASK_BARS_LIMIT;
  const row = (label, span, cls, attrs) => h('div', { class: `tl-row ${cls}`, ...attrs },
    h('div', { class: 'tl-label', title: label }, label),
    h('div', { class: 'tl-track' }, bar(span, t0, total, cls)));
  // `tl-<state>`, not the badges' `st-<state>`: those paint a whole element in the state's colour.
  const taskRows = (st) => st.tasks.map((t) => row(t.name, t, `tl-task tl-${t.state}`,
    { 'data-testid': 'timeline-task', 'data-task': t.task, 'data-state': t.state, 'data-attempts': t.attempts }));
  replace(body,
    h('div', { class: 'muted small' }, `${time(timeline.start)} – ${duration(total)}`),
    steps.map((st) => {
      const head = row(st.step, st, 'tl-step', { 'data-testid': 'timeline-step', 'data-step': st.step });
      if (!many || st.tasks.length === 1) return [head, taskRows(st)];
      // Large fan-outs: the task bars are made when asked for.
      const more = h('details', { class: 'tl-more' }, h('summary', { class: 'muted small' }, `${st.tasks.length} tasks`));
      more.addEventListener('toggle', () => {
        if (more.open && more.childElementCount === 1) more.append(...taskRows(st));
      });
      return [head, more];
    }));
}

/** The attempts of every task: worker, times, outcome, kind (the budget it drew on), error. */
export function renderAttempts(section, tbody, attempts, names) {
  section.hidden = attempts.length === 0;
  const shown = attempts.length > ATTEMPT_ROWS_LIMIT ? attempts.filter((a) => a.outcome !== 'succeeded') : attempts;
  replace(tbody, shown.map((a) => h('tr', { 'data-testid': 'run-attempt', 'data-task': a.task, 'data-kind': a.kind || '' },
    h('td', {}, names.get(a.task) || `task ${a.task}`),
    h('td', {}, String(a.attempt)),
    h('td', {}, a.worker_name),
    h('td', {}, time(a.started_at)),
    h('td', {}, a.ended_at ? time(a.ended_at) : ago(a.started_at)),
    h('td', {}, a.outcome ? badge(a.outcome) : badge('leased')),
    h('td', { 'data-testid': 'attempt-kind' }, a.kind || ''),
    h('td', { class: a.error ? 'bad' : '' }, a.error || ''))));
  section.dataset.count = String(attempts.length);
}
