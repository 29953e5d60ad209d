// The HTTP API, with the API token from localStorage as a bearer token.

const KEY = 'shardline.token';

export function getToken() {
  try { return localStorage.getItem(KEY) || ''; } catch { return ''; }
}

export function setToken(token) {
  if (token) localStorage.setItem(KEY, token.trim());
  else localStorage.removeItem(KEY);
  window.dispatchEvent(new CustomEvent('shardline:token'));
}

export class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || 'http_error';
    this.diagnostics = e.diagnostics || null;
  }
}

export function headers(extra) {
  const h = { Accept: 'application/json', ...(extra || {}) };
  const t = getToken();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

/** GET or POST a path under /api/v1; resolves to the parsed JSON, rejects with ApiError. */
export async function api(path, { method = 'GET', body, signal } = {}) {
  const init = { method, headers: headers(body !== undefined ? { 'Content-Type': 'application/json' } : {}), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const resp = await fetch(`/api/v1${path}`, init);
  const text = await resp.text();
  let json = null;
  if (text) {
    try { json = JSON.parse(text); } catch { json = null; }
  }
  if (!resp.ok) {
    const err = new ApiError(resp.status, json);
    if (resp.status === 401) window.dispatchEvent(new CustomEvent('shardline:unauthorized', { detail: err.message }));
    throw err;
  }
  return { status: resp.status, data: json };
}

export const get = (path, opts) => api(path, opts).then((r) => r.data);
