// DOM helpers. Every piece of data becomes a text node or an attribute value: no markup is
// ever parsed from data, so text from specs, logs and models stays text.

const SVG_NS = 'http://www.w3.org/2000/svg';

function apply(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') {
      el.addEventListener(k.slice(2).toLowerCase(), v);
    } else if (k === 'class') {
      el.setAttribute('class', Array.isArray(v) ? v.filter(Boolean).join(' ') : String(v));
    } else if (k === 'dataset') {
      for (const [dk, dv] of Object.entries(v)) el.dataset[dk] = String(dv);
    } else if (k === 'style' && typeof v === 'object') {
      for (const [sk, sv] of Object.entries(v)) el.style.setProperty(sk, String(sv));
    } else if (k === 'href' && /^\s*javascript:/i.test(String(v))) {
      continue;
    } else if (k.startsWith('on')) {
      continue; // never an inline handler from a string
    } else if (k === 'value' || k === 'checked' || k === 'disabled' || k === 'selected') {
      el[k] = v;
    } else {
      el.setAttribute(k, v === true ? '' : String(v));
    }
  }
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** An HTML element: h('a', {href: '/runs'}, 'text', child, …). */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

/** An SVG element. */
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || k.startsWith('on')) continue;
    if (k === 'class') el.setAttribute('class', v);
    else el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

/** Replaces the children of `el`. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A link handled by the client-side router. */
export function link(href, ...children) {
  return h('a', { href, 'data-link': true }, ...children);
}

/** A state badge. */
export function badge(state) {
  return h('span', { class: `badge st-${String(state).replace(/[^a-z_]/g, '')}`, 'data-state': state }, state);
}

/** An error box for a failed request. */
export function errorBox(err) {
  return h('div', { class: 'error', role: 'alert', 'data-testid': 'error' }, String(err && err.message ? err.message : err));
}
