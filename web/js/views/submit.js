// Submit a pipeline: start a registered one from a form of its params, or paste or upload YAML;
// YAML is linted as you type and every problem is shown at its line before anything is
// submitted.

import { api } from '../api.js';
import { h, replace, link, errorBox } from '../dom.js';
import { navigate } from '../app.js';
import { paramsForm } from './params-form.js';

const DRAFT = 'shardline.draft';

export function render(view) {
  const text = h('textarea', { spellcheck: 'false', wrap: 'off', rows: 24, 'data-testid': 'spec-input', 'aria-label': 'pipeline spec (YAML)' });
  const gutter = h('div', { class: 'gutter', 'aria-hidden': 'true' });
  const file = h('input', { type: 'file', accept: '.yaml,.yml,text/yaml,text/plain', 'data-testid': 'spec-file' });
  const name = h('input', { type: 'text', value: 'pipeline.yaml', size: 24, 'data-testid': 'spec-name' });
  const sets = h('input', { type: 'text', placeholder: 'tp=4, dp=8', size: 40, 'data-testid': 'spec-set' });
  const noCache = h('input', { type: 'checkbox', 'data-testid': 'spec-nocache' });
  const submit = h('button', { class: 'primary', 'data-testid': 'submit-run', disabled: true }, 'Submit run');
  const status = h('div', { 'data-testid': 'lint-status', class: 'lint-status' });
  const inline = h('div', { class: 'inline-lint', 'data-testid': 'lint-inline' });
  const result = h('div');
  try { text.value = sessionStorage.getItem(DRAFT) || ''; } catch { /* private mode */ }

  const registered = h('section', { class: 'panel', 'data-testid': 'params-form' });
  const closeForm = paramsForm(registered);

  replace(view,
    h('h1', {}, 'Submit a pipeline'),
    registered,
    h('h2', {}, 'Or paste a spec'),
    h('div', { class: 'filters' }, h('label', {}, 'File ', file), h('label', {}, 'Name ', name)),
    h('div', { class: 'editor' }, gutter, text),
    h('div', { class: 'filters' }, h('label', {}, 'Params ', sets), h('label', {}, noCache, ' ignore the step cache'), submit),
    status, result, inline);

  let diagnostics = [];
  let seq = 0;
  let timer = null;

  function renderGutter() {
    const n = text.value.split('\n').length;
    const bad = new Map();
    for (const d of diagnostics) bad.set(d.line, d.severity === 'error' ? 'g-error' : bad.get(d.line) || 'g-warning');
    const frag = document.createDocumentFragment();
    for (let i = 1; i <= n; i += 1) {
      frag.append(h('div', { class: bad.get(i) || '', 'data-line': i }, String(i)));
    }
    gutter.replaceChildren(frag);
    gutter.scrollTop = text.scrollTop;
  }

  function renderInline() {
    if (!diagnostics.length) { replace(inline); return; }
    const src = text.value.split('\n');
    const byLine = new Map();
    for (const d of diagnostics) {
      if (!byLine.has(d.line)) byLine.set(d.line, []);
      byLine.get(d.line).push(d);
    }
    const out = [];
    for (const [line, ds] of [...byLine.entries()].sort((a, b) => a[0] - b[0])) {
      const code = src[line - 1] ?? '';
      for (let k = Math.max(1, line - 1); k < line; k += 1) out.push(h('div', { class: 'code ctx' }, h('span', { class: 'ln' }, String(k)), src[k - 1] ?? ''));
      out.push(h('div', { class: 'code' }, h('span', { class: 'ln' }, String(line)), code));
      for (const d of ds) {
        const caret = ' '.repeat(Math.max(0, d.column - 1)) + '^'.repeat(Math.max(1, d.length || 1));
        out.push(h('div', { class: `diag ${d.severity}`, 'data-testid': 'diagnostic', 'data-line': d.line, 'data-code': d.code },
          h('div', { class: 'code caret' }, h('span', { class: 'ln' }, ''), caret),
          h('div', {}, h('strong', {}, `${d.severity}[${d.code}]`), ` line ${d.line}, column ${d.column}`, d.path ? ` (${d.path})` : '', ': ', d.message),
          d.hint ? h('div', { class: 'hint' }, `hint: ${d.hint}`) : null,
          (d.notes || []).map((n) => h('div', { class: 'hint' }, `note: ${n}`))));
      }
    }
    replace(inline, out);
  }

  async function lint() {
    const mine = ++seq;
    try { sessionStorage.setItem(DRAFT, text.value); } catch { /* ignore */ }
    if (!text.value.trim()) {
      diagnostics = [];
      submit.disabled = true;
      replace(status, 'Paste a pipeline spec or choose a file.');
      renderGutter(); renderInline();
      return false;
    }
    try {
      const { data } = await api('/lint', { method: 'POST', body: { spec: text.value, file: name.value || 'pipeline.yaml' } });
      if (mine !== seq) return false;
      diagnostics = data.diagnostics;
      const errors = diagnostics.filter((d) => d.severity === 'error').length;
      const warnings = diagnostics.length - errors;
      submit.disabled = !data.valid;
      replace(status, h('span', { class: data.valid ? 'good' : 'bad', 'data-valid': String(data.valid) },
        data.valid ? `Lint: ok${warnings ? `, ${warnings} warning${warnings === 1 ? '' : 's'}` : ''}.` : `Lint: ${errors} error${errors === 1 ? '' : 's'}${warnings ? `, ${warnings} warning${warnings === 1 ? '' : 's'}` : ''}; fix ${errors === 1 ? 'it' : 'them'} to submit.`));
      renderGutter(); renderInline();
      return data.valid;
    } catch (e) {
      if (mine === seq) replace(status, errorBox(e));
      return false;
    }
  }

  const schedule = () => { clearTimeout(timer); renderGutter(); timer = setTimeout(lint, 300); };
  text.addEventListener('input', schedule);
  text.addEventListener('scroll', () => { gutter.scrollTop = text.scrollTop; });
  name.addEventListener('change', schedule);
  file.addEventListener('change', async () => {
    const f = file.files && file.files[0];
    if (!f) return;
    text.value = await f.text();
    name.value = f.name;
    schedule();
  });

  submit.addEventListener('click', async () => {
    replace(result);
    if (!(await lint())) return;
    const set = {};
    for (const part of sets.value.split(',').map((x) => x.trim()).filter(Boolean)) {
      const eq = part.indexOf('=');
      if (eq <= 0) { replace(result, errorBox(`\`${part}\` is not name=value`)); return; }
      set[part.slice(0, eq).trim()] = part.slice(eq + 1).trim();
    }
    submit.disabled = true;
    try {
      const { data } = await api('/runs', { method: 'POST', body: { spec: text.value, file: name.value || 'pipeline.yaml', set, no_cache: noCache.checked } });
      try { sessionStorage.removeItem(DRAFT); } catch { /* ignore */ }
      navigate(`/runs/${data.run}`);
    } catch (e) {
      submit.disabled = false;
      if (e.diagnostics) { diagnostics = e.diagnostics; renderGutter(); renderInline(); }
      replace(result, errorBox(e), e.status === 401 || e.status === 403 ? h('p', {}, link('/token', 'Set a token with scope submit.')) : null);
    }
  });

  renderGutter();
  lint();
  return () => { clearTimeout(timer); closeForm(); };
}
