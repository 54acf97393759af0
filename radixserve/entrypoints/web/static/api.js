// The page's only way to the server: fetch() with the API key as a bearer token.
// EventSource cannot send headers, so server-sent events are read from a fetch() body stream here.

export const config = JSON.parse(document.getElementById('rs-config').textContent || '{}');

const KEY_STORAGE = 'radixserve.apiKey';  // sessionStorage: the key is forgotten with the tab

export const apiKey = {
  get() { return sessionStorage.getItem(KEY_STORAGE) || ''; },
  set(value) {
    if (value) sessionStorage.setItem(KEY_STORAGE, value); else sessionStorage.removeItem(KEY_STORAGE);
  },
  // No request is made before a key exists when the server wants one (a 401 would be a console error).
  ready() { return !config.api_key_required || this.get() !== ''; },
};

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey.get();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorFrom(resp) {
  let body = null;
  try { body = await resp.json(); } catch { /* not JSON */ }
  const message = body && body.error && body.error.message ? body.error.message : `HTTP ${resp.status}`;
  return new ApiError(resp.status, message, body);
}

export async function getJSON(path, signal) {
  const resp = await fetch(path, { headers: headers(), signal });
  if (!resp.ok) throw await errorFrom(resp);
  return resp.json();
}

// POST (or GET when body is null) and yield the `data:` payload of every server-sent event.
export async function* streamEvents(path, body, signal) {
  const init = { headers: headers(body === null ? {} : { 'Content-Type': 'application/json' }), signal };
  if (body !== null) { init.method = 'POST'; init.body = JSON.stringify(body); }
  const resp = await fetch(path, init);
  if (!resp.ok) throw await errorFrom(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart());
        if (data.length) yield data.join('\n');  // lines starting with ':' are keep-alives
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

export function isAbort(err) {
  return Boolean(err) && err.name === 'AbortError';
}

// Small DOM helper: el('td', {class: 'x', title: 'y'}, child, 'text', ...)
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k === 'text') node.textContent = v;
    else node.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

export function fmtInt(n) { return Number.isFinite(n) ? Math.round(n).toLocaleString('en-US') : '–'; }
export function fmtRate(n) { return Number.isFinite(n) ? (n >= 100 ? Math.round(n).toString() : n.toFixed(1)) : '–'; }
export function shortRid(rid) { return rid.length > 14 ? '…' + rid.slice(-8) : rid; }
