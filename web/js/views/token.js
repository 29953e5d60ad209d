// The API token this browser sends (kept in localStorage).

import { getToken, setToken, get } from '../api.js';
import { h, replace } from '../dom.js';

export function render(view) {
  const input = h('input', { type: 'password', autocomplete: 'off', placeholder: 'shl_…', size: 72, 'data-testid': 'token-input' });
  const status = h('p', { 'data-testid': 'token-status' });
  const show = () => {
    const t = getToken();
    status.textContent = t ? `A token ending in …${t.slice(-4)} is set.` : 'No token is set.';
  };
  const save = h('button', {
    'data-testid': 'token-save',
    onclick: async () => {
      setToken(input.value);
      input.value = '';
      show();
      try {
        await get('/runs?limit=1');
        status.textContent += ' The server accepts it.';
      } catch (e) {
        status.textContent += ` The server refused it: ${e.message}`;
      }
    },
  }, 'Save');
  const clear = h('button', { onclick: () => { setToken(''); show(); } }, 'Forget');
  replace(view,
    h('h1', {}, 'API token'),
    h('p', {}, 'Submitting needs a token of scope submit, cancelling and retrying one of scope admin; the server may also want one (scope read) for every page. Create one with ',
      h('code', {}, 'shardline token create --scope submit'), '. It is kept in this browser only.'),
    h('div', { class: 'filters' }, input, save, clear),
    status);
  show();
}
