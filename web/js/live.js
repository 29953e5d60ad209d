// Live updates from GET /api/v1/events (server-sent events). Without a token the browser's
// EventSource reads the stream; with one, a fetch stream does (EventSource cannot send an
// Authorization header). Both resume after the last event id when they reconnect.

import { headers, getToken } from './api.js';

const listeners = new Set();
let lastId = null;
let source = null;
let controller = null;
let retryTimer = null;
let retryDelay = 500;

/** Calls fn(event) for every `run` and `task` event; returns a function that unsubscribes. */
export function subscribe(fn) {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

function setStatus(text, ok) {
  const el = document.getElementById('live');
  if (!el) return;
  el.textContent = text;
  el.classList.toggle('ok', !!ok);
  el.classList.toggle('down', !ok);
}

function dispatch(kind, data, id) {
  if (id) lastId = id;
  if (kind !== 'run' && kind !== 'task') return;
  let ev;
  try { ev = JSON.parse(data); } catch { return; }
  // Counted for the end-to-end test (and anyone curious in the console).
  const stats = (window.__shardline ||= {});
  stats.events = (stats.events || 0) + 1;
  stats.stream = source ? 'eventsource' : 'fetch';
  for (const fn of listeners) {
    try { fn(ev); } catch (e) { console.warn('event listener failed', e); }
  }
}

function scheduleReconnect() {
  setStatus('reconnecting…', false);
  clearTimeout(retryTimer);
  retryTimer = setTimeout(connect, retryDelay);
  retryDelay = Math.min(retryDelay * 2, 10000);
}

function connectEventSource() {
  const url = lastId ? `/api/v1/events?after=${encodeURIComponent(lastId)}` : '/api/v1/events';
  source = new EventSource(url);
  source.onopen = () => { retryDelay = 500; setStatus('live', true); };
  for (const kind of ['run', 'task']) {
    source.addEventListener(kind, (e) => dispatch(kind, e.data, e.lastEventId));
  }
  source.onerror = () => {
    source.close();
    source = null;
    scheduleReconnect();
  };
}

async function connectFetch() {
  controller = new AbortController();
  const url = lastId ? `/api/v1/events?after=${encodeURIComponent(lastId)}` : '/api/v1/events';
  try {
    const resp = await fetch(url, { headers: headers({ Accept: 'text/event-stream' }), signal: controller.signal });
    if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
    retryDelay = 500;
    setStatus('live', true);
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let at;
      while ((at = buf.search(/\r?\n\r?\n/)) >= 0) {
        const block = buf.slice(0, at);
        buf = buf.slice(at).replace(/^\r?\n\r?\n/, '');
        let kind = 'message';
        let id = null;
        const data = [];
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith(':')) continue;
          const colon = line.indexOf(':');
          const field = colon < 0 ? line : line.slice(0, colon);
          const val = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
          if (field === 'event') kind = val;
          else if (field === 'data') data.push(val);
          else if (field === 'id') id = val;
        }
        dispatch(kind, data.join('\n'), id);
      }
    }
  } catch (e) {
    if (e.name === 'AbortError') return;
  }
  controller = null;
  scheduleReconnect();
}

function disconnect() {
  clearTimeout(retryTimer);
  if (source) { source.close(); source = null; }
  if (controller) { controller.abort(); controller = null; }
}

/** (Re)connects the stream, e.g. after the token changed. */
export function connect() {
  disconnect();
  setStatus('connecting…', false);
  if (getToken()) connectFetch();
  else connectEventSource();
}

window.addEventListener('shardline:token', connect);
