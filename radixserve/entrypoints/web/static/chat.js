// Chat playground: streams /v1/chat/completions (the server applies the model's chat template).
// Per answer: prompt / completion / cached tokens (the server's usage), TTFT and decode tok/s
// (measured here, from the stream), and a link to the request's trace in the scheduler's step log.

import { ApiError, el, fmtInt, isAbort, streamEvents } from './api.js';

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content, node}: what the next request sends (after the system prompt)
let controller = null;  // the AbortController of the answer being streamed
const pending = [];  // data: URIs of the images attached to the next message

function readParams() {
  const num = (id, parse) => {
    const raw = $(id).value.trim();
    if (raw === '') return undefined;
    const v = parse(raw);
    return Number.isFinite(v) ? v : undefined;
  };
  const params = {
    temperature: num('p-temperature', parseFloat),
    top_p: num('p-top_p', parseFloat),
    top_k: num('p-top_k', (s) => parseInt(s, 10)),
    max_tokens: num('p-max_tokens', (s) => parseInt(s, 10)),
    seed: num('p-seed', (s) => parseInt(s, 10)),
  };
  if (params.top_k === -1) delete params.top_k;  // -1 = off, the server's default
  const stop = $('p-stop').value.split('\n').filter((s) => s !== '');
  if (stop.length) params.stop = stop;
  for (const k of Object.keys(params)) if (params[k] === undefined) delete params[k];
  return params;
}

function addMessage(role, content, images = []) {
  const body = el('div', { class: 'content', text: content });
  const thumbs = images.length ? el('div', { class: 'images' }, ...images.map((src) => el('img', { class: 'thumb', src, alt: 'image' }))) : null;
  const node = el('div', { class: `msg msg-${role}`, 'data-role': role },
    el('div', { class: 'role', text: role === 'user' ? 'you' : 'assistant' }), thumbs, body);
  $('messages').append(node);
  node.scrollIntoView({ block: 'end' });
  const msg = { role, content, images, node, body };
  history.push(msg);
  return msg;
}

function setBusy(busy) {
  $('send').disabled = busy;
  $('stop').disabled = !busy;
  const last = history[history.length - 1];
  $('regenerate').disabled = busy || !last || last.role !== 'assistant';
}

function showError(text) {
  const box = $('chat-error');
  box.hidden = !text;
  box.textContent = text || '';
}

function usageLine(msg, stats) {
  const parts = [];
  const item = (label, value, key) => {
    const span = el('span', { class: 'stat', 'data-key': key }, el('span', { class: 'muted', text: label + ' ' }), value);
    parts.push(span);
  };
  const u = stats.usage;
  if (u) {
    item('prompt', fmtInt(u.prompt_tokens), 'prompt_tokens');
    item('completion', fmtInt(u.completion_tokens), 'completion_tokens');
    item('cached', fmtInt((u.prompt_tokens_details || {}).cached_tokens || 0), 'cached_tokens');
  } else {
    item('chunks', fmtInt(stats.chunks), 'chunks');
  }
  if (stats.ttftMs !== null) item('TTFT', `${Math.round(stats.ttftMs)} ms`, 'ttft');
  const decoded = u ? u.completion_tokens - 1 : stats.chunks - 1;
  const span = (stats.lastMs - stats.firstMs) / 1000;
  if (decoded > 0 && span > 0) item('', `${(decoded / span).toFixed(1)} tok/s`, 'tok_s');
  if (stats.finish) item('finish', stats.finish, 'finish');
  const line = el('div', { class: 'usage', 'data-state': stats.state }, ...parts);
  if (u) {
    line.dataset.promptTokens = u.prompt_tokens;
    line.dataset.completionTokens = u.completion_tokens;
    line.dataset.cachedTokens = (u.prompt_tokens_details || {}).cached_tokens || 0;
  }
  if (stats.rid) line.append(el('a', { href: `#trace/${encodeURIComponent(stats.rid)}`, class: 'trace-link', title: stats.rid, text: 'trace' }));
  const old = msg.node.querySelector('.usage');
  if (old) old.replaceWith(line); else msg.node.append(line);
}

async function answer() {
  const system = $('system-prompt').value.trim();
  const messages = system ? [{ role: 'system', content: system }] : [];
  for (const m of history) if (!m.failed) messages.push({ role: m.role, content: messageContent(m) });
  const body = { model: 'default', messages, stream: true, stream_options: { include_usage: true }, ...readParams() };
  const msg = addMessage('assistant', '');
  msg.node.dataset.state = 'streaming';
  controller = new AbortController();
  setBusy(true);
  showError('');
  const stats = { usage: null, chunks: 0, ttftMs: null, firstMs: 0, lastMs: 0, finish: null, rid: null, state: 'streaming' };
  const t0 = performance.now();
  try {
    for await (const data of streamEvents('/v1/chat/completions', body, controller.signal)) {
      if (data === '[DONE]') break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(0, chunk.error.message, chunk);
      stats.rid = chunk.id || stats.rid;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta || {}).content;
        if (piece) {
          const now = performance.now();
          if (stats.ttftMs === null) { stats.ttftMs = now - t0; stats.firstMs = now; }
          stats.lastMs = now;
          stats.chunks += 1;
          msg.node.dataset.chunks = stats.chunks;
          msg.content += piece;
          msg.body.textContent = msg.content;
        }
        if (choice.finish_reason) stats.finish = choice.finish_reason;
      }
      if (chunk.usage) stats.usage = chunk.usage;
      msg.node.scrollIntoView({ block: 'end' });
    }
    stats.state = 'done';
  } catch (err) {
    if (isAbort(err)) {
      stats.state = 'stopped';
      stats.finish = 'stopped';
    } else {
      stats.state = 'error';
      msg.failed = msg.content === '';  // an empty failed answer is not sent back as context
      showError(err.message || String(err));
    }
  } finally {
    controller = null;
    msg.node.dataset.state = stats.state;
    usageLine(msg, stats);
    setBusy(false);
  }
}

// OpenAI content parts when the message has images (the images first, as LLaVA-style templates place them)
function messageContent(m) {
  if (!m.images || !m.images.length) return m.content;
  return [...m.images.map((url) => ({ type: 'image_url', image_url: { url } })), { type: 'text', text: m.content }];
}

function showAttachments() {
  const box = $('attachments');
  box.replaceChildren(...pending.map((src) => el('img', { class: 'thumb', src, alt: 'attached image' })));
  box.hidden = pending.length === 0;
}

function attach(event) {
  for (const file of event.target.files) {
    const reader = new FileReader();
    reader.onload = () => { pending.push(reader.result); showAttachments(); };
    reader.readAsDataURL(file);
  }
  event.target.value = '';  // the same file may be attached again
}

function send(event) {
  event.preventDefault();
  const input = $('chat-input');
  const text = input.value.trim();
  if ((!text && !pending.length) || controller) return;
  input.value = '';
  addMessage('user', text, pending.splice(0));
  showAttachments();
  answer();
}

function regenerate() {
  const last = history[history.length - 1];
  if (controller || !last || last.role !== 'assistant') return;
  history.pop();
  last.node.remove();
  answer();
}

function newChat() {
  if (controller) controller.abort();
  history.length = 0;
  pending.length = 0;
  showAttachments();
  $('messages').replaceChildren();
  showError('');
  setBusy(false);
}

export function initChat() {
  $('chat-form').addEventListener('submit', send);
  $('chat-input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); $('chat-form').requestSubmit(); }
  });
  $('stop').addEventListener('click', () => { if (controller) controller.abort(); });
  $('attach').addEventListener('click', () => $('chat-image').click());
  $('chat-image').addEventListener('change', attach);
  $('regenerate').addEventListener('click', regenerate);
  $('new-chat').addEventListener('click', newChat);
  setBusy(false);
}
