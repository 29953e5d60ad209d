// Start a registered pipeline from a form of its params instead of pasting YAML: choosing a
// pipeline shows one input per declared param (by type; a select for `enum:` choices and
// bools), prefilled with its default. Submitting sends the pipeline's name with the params that
// differ from their defaults (`set`); the server submits its stored spec. Errors from the
// server (a value of the wrong type, a failed lint) are shown next to the form.

import { api, get } from '../api.js';
import { h, replace, link, errorBox } from '../dom.js';
import { navigate } from '../app.js';

function inputFor(p) {
  const attrs = { name: p.name, 'data-testid': `param-${p.name}`, 'data-type': p.type, 'aria-label': p.name };
  if (p.choices.length || p.type === 'bool') {
    const values = p.choices.length ? p.choices : ['true', 'false'];
    const options = values.map((v) => h('option', { value: v, selected: v === p.default }, v));
    if (p.default === null || p.default === undefined) options.unshift(h('option', { value: '' }, '(choose)'));
    return h('select', attrs, options);
  }
  const type = p.type === 'int' ? 'number' : 'text';
  const placeholder = { path: '/path/or/url', size: 'e.g. 4GiB', duration: 'e.g. 90s' }[p.type] || '';
  return h('input', { ...attrs, type, step: p.type === 'int' ? 1 : undefined, value: p.default ?? '', placeholder, required: p.default === null || p.default === undefined });
}

/** The "start a registered pipeline" form, rendered into `box`. */
export function paramsForm(box) {
  const choose = h('select', { 'data-testid': 'pipeline-select', 'aria-label': 'registered pipeline' }, h('option', { value: '' }, '(choose a pipeline)'));
  const fields = h('div', { class: 'param-fields', 'data-testid': 'param-fields' });
  const noCache = h('input', { type: 'checkbox', 'data-testid': 'params-nocache' });
  const start = h('button', { class: 'primary', 'data-testid': 'start-pipeline', disabled: true }, 'Start run');
  const result = h('div', { 'data-testid': 'params-result' });
  let params = [];
  let stopped = false;

  replace(box,
    h('h2', {}, 'Start a registered pipeline'),
    h('div', { class: 'filters' }, h('label', {}, 'Pipeline ', choose)),
    fields,
    h('div', { class: 'filters' }, h('label', {}, noCache, ' ignore the step cache'), start),
    result);

  get('/pipelines').then((ps) => {
    if (stopped) return;
    if (!ps.length) { replace(fields, h('p', { class: 'muted' }, 'No pipeline has been submitted yet.')); return; }
    choose.append(...ps.map((p) => h('option', { value: p.name }, p.name)));
  }).catch((e) => { if (!stopped) replace(result, errorBox(e)); });

  choose.addEventListener('change', async () => {
    replace(result);
    replace(fields);
    start.disabled = true;
    params = [];
    const name = choose.value;
    if (!name) return;
    try {
      const d = await get(`/pipelines/${encodeURIComponent(name)}`);
      if (stopped || choose.value !== name) return;
      params = d.params || [];
      replace(fields, params.length
        ? h('table', { class: 'grid params' }, h('tbody', {}, params.map((p) => h('tr', {},
          h('th', {}, h('label', {}, p.name)),
          h('td', {}, inputFor(p)),
          h('td', { class: 'muted small' }, [p.type, p.description].filter(Boolean).join(' · '))))))
        : h('p', { class: 'muted' }, 'This pipeline declares no params.'));
      start.disabled = false;
    } catch (e) {
      replace(result, errorBox(e));
    }
  });

  start.addEventListener('click', async () => {
    replace(result);
    const set = {};
    for (const p of params) {
      const el = fields.querySelector(`[name="${CSS.escape(p.name)}"]`);
      if (!el) continue;
      const value = el.value.trim();
      if (value === '' && (p.default === null || p.default === undefined)) {
        replace(result, errorBox(`\`${p.name}\` has no default: give it a value.`));
        el.focus();
        return;
      }
      // Only what differs from the default: the run's params then say what was chosen.
      if (value !== '' && value !== p.default) set[p.name] = value;
    }
    start.disabled = true;
    try {
      const { data } = await api('/runs', { method: 'POST', body: { pipeline: choose.value, set, no_cache: noCache.checked } });
      navigate(`/runs/${data.run}`);
    } catch (e) {
      start.disabled = false;
      const diags = (e.diagnostics || []).map((d) => h('div', { class: `diag ${d.severity}`, 'data-testid': 'params-diagnostic' },
        h('strong', {}, `${d.severity}[${d.code}]`), ` ${d.path ? `${d.path}: ` : ''}${d.message}`));
      replace(result, errorBox(e), diags, e.status === 401 || e.status === 403 ? h('p', {}, link('/token', 'Set a token with scope submit.')) : null);
    }
  });

  return () => { stopped = true; };
}
