// Live dashboard: reads GET /v1/stream/metrics (server-sent events) while the tab is shown.
// Every snapshot is the scheduler's get_server_info() counters plus its newest step records (the
// record --trace-batches writes), so the numbers here are the ones /metrics and the trace file show.

import { config, el, fmtInt, fmtRate, isAbort, shortRid, streamEvents } from './api.js';
import { LineChart } from './charts.js';

const $ = (id) => document.getElementById(id);

// Scheduler.wait_reason -> what it means (why the requests still waiting were not admitted)
const WAIT_REASONS = {
  max_running_requests: 'the running batch is full (--max-running-requests)',
  kv_budget: "not enough KV for the prompt plus the running requests' reserved decode tokens",
  max_prefill_tokens: "this step's prefill token budget is spent (--max-prefill-tokens)",
  chunked_prefill_size: "this step's chunk budget is spent (--chunked-prefill-size)",
  swa_budget: "the sliding-window pool's free local KV is spent (--swa-full-tokens-ratio)",
  chunked_prefill: 'a long prompt is prefilled in chunks; the queue waits for its next chunk',
  in_batch_prefix: 'held back one step: a request in this batch computes the prefix it shares',
  kv_pool: 'the KV pool refused the allocation; retried after decode frees slots',
};
const SHOWN_RIDS = 6;  // request chips per step row; the rest are counted

let controller = null;
let paused = false;
let chart = null;

function setStatus(text, kind) {
  const s = $('dash-status');
  s.textContent = text;
  s.dataset.kind = kind;
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

async function run(ctl) {
  while (!ctl.signal.aborted) {
    const url = `/v1/stream/metrics?interval_ms=${$('dash-interval').value}&steps=${$('dash-steps').value}`;
    setStatus('connecting…', 'wait');
    try {
      for await (const data of streamEvents(url, null, ctl.signal)) render(JSON.parse(data));
      setStatus('stream ended', 'off');  // the server is shutting down
    } catch (err) {
      if (isAbort(err)) return;
      setStatus(`error: ${err.message}`, 'error');
    }
    await sleep(2000, ctl.signal);  // reconnect
  }
}

export function startDashboard() {
  if (controller || paused) return;
  controller = new AbortController();
  run(controller);
}

export function stopDashboard() {
  if (controller) controller.abort();
  controller = null;
}

function restart() { stopDashboard(); startDashboard(); }

function setText(id, text) { $(id).textContent = text; }

function renderKV(kv) {
  const total = Math.max(1, kv.total);
  for (const part of document.querySelectorAll('#kv-bar .kv-part')) {
    const tokens = kv[part.dataset.part] || 0;
    part.dataset.tokens = tokens;
    part.style.width = `${(100 * tokens) / total}%`;
    part.title = `${part.dataset.part}: ${fmtInt(tokens)} tokens`;
  }
  setText('kv-total', `${fmtInt(kv.total)} slots`);
  setText('kv-running', fmtInt(kv.running));
  setText('kv-cached-locked', fmtInt(kv.cached_locked));
  setText('kv-cached-evictable', fmtInt(kv.cached_evictable));
  setText('kv-free', fmtInt(kv.free));
}

function ridChips(sched) {
  const chips = sched.rids.slice(0, SHOWN_RIDS).map((rid, i) => el('span', { class: 'rid' },
    el('a', { href: `#trace/${encodeURIComponent(rid)}`, title: rid, text: shortRid(rid) }),
    el('span', { class: 'lens', title: 'prefix (cached or already computed) + extend (computed now)',
      text: ` ${sched.prefix_lens[i]}+${sched.extend_lens[i]}` })));
  if (sched.rids.length > SHOWN_RIDS) chips.push(el('span', { class: 'muted', text: `+${sched.rids.length - SHOWN_RIDS} more` }));
  return el('div', { class: 'rids' }, ...chips);
}

function timingBar(t) {
  const parts = [['schedule', t.schedule_ms], ['build', t.build_ms], ['forward', t.forward_ms], ['sample', t.sample_ms]];
  const total = parts.reduce((a, [, v]) => a + v, 0) || 1;
  const bar = el('div', { class: 'split-bar' });
  for (const [name, v] of parts) {
    const seg = el('div', { class: `seg seg-${name}`, title: `${name}: ${v.toFixed(2)} ms` });
    seg.style.width = `${(100 * v) / total}%`;
    bar.append(seg);
  }
  const text = el('div', { class: 'small' },
    `forward ${t.forward_ms.toFixed(1)} · sample ${t.sample_ms.toFixed(2)} · build ${t.build_ms.toFixed(2)} · schedule ${t.schedule_ms.toFixed(2)} ms`);
  return [bar, text];
}

function stepRow(step, now) {
  const s = step.schedule;
  const f = step.forward;
  const ago = Math.max(0, now - step.time);
  const waiting = s.num_waiting
    ? el('div', { class: 'small waiting', title: WAIT_REASONS[s.wait_reason] || '' },
      `${s.num_waiting} waiting`, s.wait_reason ? ` — ${s.wait_reason}` : '')
    : el('div', { class: 'small muted', text: 'queue empty' });
  const chunked = s.chunked_rid ? el('div', { class: 'small', text: `chunked: ${shortRid(s.chunked_rid)}` }) : null;
  const pos = f.positions_range ? `${f.positions_range[0]}–${f.positions_range[1]}` : '–';
  return el('tr', { 'data-step': step.step },
    el('td', {}, el('b', { text: `#${step.step}` }),
      config.dp_size > 1 ? el('div', { class: 'small', text: `replica ${step.dp_rank}` }) : null,
      el('div', { class: 'small muted', text: `${ago.toFixed(1)} s ago` })),
    el('td', {}, el('span', { class: `mode mode-${s.mode}`, text: s.mode }), ` ${s.rids.length} req`, ridChips(s), waiting, chunked),
    el('td', {}, el('span', { class: `mode mode-${f.forward_mode}`, text: f.forward_mode }),
      el('div', { class: 'small', text: `bs ${f.batch_size} · ${fmtInt(f.num_tokens)} tokens · positions ${pos}` })),
    el('td', {}, ...timingBar(step.timing)));
}

// --dp-size > 1: one row per replica (server_info.dp: the router's counts and the replica's own)
function renderReplicas(reps) {
  const panel = $('replicas-panel');
  panel.hidden = !(reps && reps.length > 1);
  if (panel.hidden) return;
  document.querySelector('#replicas tbody').replaceChildren(...reps.map((r) => el('tr', { 'data-dp-rank': r.dp_rank },
    el('td', { text: String(r.dp_rank) }), el('td', { text: fmtInt(r.num_running_reqs) }),
    el('td', { text: fmtInt(r.num_waiting_reqs) }), el('td', { text: fmtInt(r.num_in_flight_reqs) }),
    el('td', { text: fmtInt(r.num_served_reqs) }), el('td', { text: `${(100 * (r.cache_hit_rate || 0)).toFixed(1)}%` }),
    el('td', { text: `${fmtInt(r.num_used_tokens)} / ${fmtInt(r.num_cached_tokens)} / ${fmtInt(r.max_total_num_tokens)}` }))));
}

function render(snap) {
  setText('dash-meta', `snapshot ${snap.seq} · ${snap.num_streams} stream(s) · shared poll every ${snap.poll_interval_s * 1000} ms`);
  if (snap.error) { setStatus(`scheduler: ${snap.error}`, 'error'); return; }
  setStatus('live', 'live');
  const info = snap.server_info;
  setText('m-running', fmtInt(info.num_running_reqs));
  setText('m-waiting', fmtInt(info.num_waiting_reqs));
  setText('m-retracted', `${fmtInt(info.num_retracted_waiting_reqs)} / ${fmtInt(info.num_retractions)}`);
  setText('m-hit-rate', `${(100 * (info.cache_hit_rate || 0)).toFixed(1)}%`);
  setText('m-input-tps', fmtRate(snap.rates.input_tok_s));
  setText('m-output-tps', fmtRate(snap.rates.output_tok_s));
  setText('m-steps-ps', fmtRate(snap.rates.steps_s));
  renderKV(snap.kv);
  renderReplicas(info.dp);
  chart.push({ input: snap.rates.input_tok_s, output: snap.rates.output_tok_s });
  const rows = snap.steps.slice().reverse().map((s) => stepRow(s, snap.time));
  const body = document.querySelector('#pipeline tbody');
  if (rows.length) body.replaceChildren(...rows);
  else body.replaceChildren(el('tr', {}, el('td', { colspan: 4, class: 'muted', text: 'no step has run yet' })));
}

export function initDashboard() {
  chart = new LineChart($('tput-chart'), [{ key: 'input', className: 'line-input' }, { key: 'output', className: 'line-output' }]);
  chart.draw();
  $('dash-interval').addEventListener('change', () => { if (controller) restart(); });
  $('dash-steps').addEventListener('change', () => { if (controller) restart(); });
  $('dash-pause').addEventListener('click', () => {
    paused = !paused;
    $('dash-pause').textContent = paused ? 'Resume' : 'Pause';
    if (paused) { stopDashboard(); setStatus('paused', 'off'); } else startDashboard();
  });
}
