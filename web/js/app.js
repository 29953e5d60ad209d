// The dashboard's router: pages render into <main id="view"> and return a cleanup function;
// links marked data-link navigate without reloading.

import { connect } from './live.js';
import { h, replace } from './dom.js';
import * as runs from './views/runs.js';
import * as run from './views/run.js';
import * as workers from './views/workers.js';
import * as storage from './views/storage.js';
import * as pipelines from './views/pipelines.js';
import * as submit from './views/submit.js';
import * as token from './views/token.js';

const routes = [
  [/^\/(?:runs\/?)?$/, runs, 'runs'],
  [/^\/runs\/(\d+)\/?$/, run, 'runs'],
  [/^\/workers\/?$/, workers, 'workers'],
  [/^\/storage\/?$/, storage, 'storage'],
  [/^\/pipelines\/?$/, pipelines, 'pipelines'],
  [/^\/submit\/?$/, submit, 'submit'],
  [/^\/token\/?$/, token, 'token'],
];

let cleanup = null;

function render() {
  const view = document.getElementById('view');
  if (cleanup) {
    try { cleanup(); } catch (e) { console.warn(e); }
    cleanup = null;
  }
  const path = location.pathname;
  const params = new URLSearchParams(location.search);
  for (const [re, mod, nav] of routes) {
    const m = path.match(re);
    if (!m) continue;
    for (const a of document.querySelectorAll('[data-nav]')) a.classList.toggle('active', a.dataset.nav === nav);
    document.title = mod === run ? `Run #${m[1]} · Shardline` : `${nav[0].toUpperCase()}${nav.slice(1)} · Shardline`;
    replace(view);
    cleanup = mod.render(view, m.slice(1), params) || null;
    return;
  }
  replace(view, h('h1', {}, 'Not found'), h('p', {}, 'There is no page at ', h('code', {}, path), '.'));
}

/** Navigates to a path of the dashboard without reloading. */
export function navigate(href, { replace: rep = false } = {}) {
  if (rep) history.replaceState(null, '', href);
  else history.pushState(null, '', href);
  render();
}

document.addEventListener('click', (e) => {
  const a = e.target.closest('a[data-link]');
  if (!a || e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin) return;
  e.preventDefault();
  navigate(url.pathname + url.search);
});

window.addEventListener('popstate', render);

window.addEventListener('shardline:unauthorized', (e) => {
  const b = document.getElementById('banner');
  replace(b, String(e.detail || 'This request needs an API token.'), ' ', h('a', { href: '/token', 'data-link': true }, 'Set a token'));
  b.hidden = false;
});
window.addEventListener('shardline:token', () => {
  document.getElementById('banner').hidden = true;
});

render();
connect();
