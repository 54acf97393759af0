// One request's trace: the scheduler's step records that ran it (GET /debug/steps?rid=...), oldest
// first -- the same records the dashboard's pipeline shows and --trace-batches writes.

import { el, fmtInt, getJSON, isAbort } from './api.js';

const $ = (id) => document.getElementById(id);
let controller = null;

function showError(text) {
  const box = $('trace-error');
  box.hidden = !text;
  box.textContent = text || '';
}

function row(step, rid) {
  const s = step.schedule;
  const f = step.forward;
  const t = step.timing;
  const i = s.rids.indexOf(rid);
  const pos = f.positions_range ? `${f.positions_range[0]}–${f.positions_range[1]}` : '–';
  return el('tr', { 'data-step': step.step },
    el('td', { text: `#${step.step}` }),
    el('td', { class: 'small', text: new Date(step.time * 1000).toLocaleTimeString() }),
    el('td', {}, el('span', { class: `mode mode-${s.mode}`, text: s.mode })),
    el('td', { text: `${s.prefix_lens[i]} + ${s.extend_lens[i]}` }),
    el('td', { text: `${f.batch_size} req · ${fmtInt(f.num_tokens)} tokens` }),
    el('td', { text: pos }),
    el('td', { class: 'small', text: `forward ${t.forward_ms.toFixed(1)} · sample ${t.sample_ms.toFixed(2)} · build ${t.build_ms.toFixed(2)} ms` }));
}

export async function showTrace(rid) {
  if (controller) controller.abort();
  controller = new AbortController();
  $('trace-title').textContent = `trace of ${rid}`;
  showError('');
  const body = document.querySelector('#trace-table tbody');
  body.replaceChildren();
  try {
    const data = await getJSON(`/debug/steps?rid=${encodeURIComponent(rid)}&limit=512`, controller.signal);
    const steps = data.steps;
    body.replaceChildren(...steps.map((s) => row(s, rid)));
    if (!steps.length) {
      $('trace-summary').textContent = `No step of the last ${data.ring_size} (steps ${data.oldest_step}–${data.last_step}) ran this request.`;
      return;
    }
    const modes = {};
    for (const s of steps) modes[s.schedule.mode] = (modes[s.schedule.mode] || 0) + 1;
    const first = steps[0].schedule;
    const k = first.rids.indexOf(rid);
    $('trace-summary').textContent = `${steps.length} steps (${Object.entries(modes).map(([m, n]) => `${n} ${m}`).join(', ')}); `
      + `first step #${steps[0].step}: ${first.prefix_lens[k]} tokens from the cache, ${first.extend_lens[k]} computed.`;
  } catch (err) {
    if (!isAbort(err)) showError(err.message || String(err));
  }
}
