// The page's entry point: the API key, the tabs (#chat, #dashboard, #tree, #trace/<rid>).

import { apiKey, config, getJSON } from './api.js';
import { initChat } from './chat.js';
import { initDashboard, startDashboard, stopDashboard } from './dashboard.js';
import { initTree, refreshTree } from './tree.js';
import { showTrace } from './trace.js';

const $ = (id) => document.getElementById(id);
const VIEWS = ['chat', 'dashboard', 'tree', 'trace'];

async function checkKey() {
  const status = $('key-status');
  if (!apiKey.ready()) {
    status.textContent = 'this server needs its API key';
    return false;
  }
  try {
    const models = await getJSON('/v1/models');
    $('model-name').textContent = models.data.length ? models.data[0].id : '';
    status.textContent = config.api_key_required ? 'key accepted' : '';
    document.body.dataset.ready = 'true';
    return true;
  } catch (err) {
    status.textContent = err.status === 401 ? 'wrong key' : `error: ${err.message}`;
    return false;
  }
}

function route() {
  const hash = decodeURIComponent(location.hash.replace(/^#/, '')) || 'chat';
  const [view, ...rest] = hash.split('/');
  const name = VIEWS.includes(view) ? view : 'chat';
  for (const v of VIEWS) $(`view-${v}`).hidden = v !== name;
  for (const a of document.querySelectorAll('.tabs a')) a.classList.toggle('active', a.dataset.view === name);
  if (!apiKey.ready()) return;
  if (name === 'dashboard') startDashboard(); else stopDashboard();  // stream only while watched
  if (name === 'tree') refreshTree();
  if (name === 'trace' && rest.length) showTrace(rest.join('/'));
}

async function init() {
  initChat();
  initDashboard();
  initTree();
  if (config.api_key_required) {
    const form = $('key-form');
    form.hidden = false;
    $('api-key').value = apiKey.get();
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      apiKey.set($('api-key').value.trim());
      if (await checkKey()) route();
    });
  }
  window.addEventListener('hashchange', route);
  await checkKey();
  route();
}

init();
