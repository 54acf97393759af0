// Radix tree view: GET /debug/radix_tree (bounded: max_nodes breadth first, max_depth levels),
// rendered as nested <details> so every prefix folds. Refreshed on demand only.

import { config, el, fmtInt, getJSON, isAbort } from './api.js';

const $ = (id) => document.getElementById(id);
let controller = null;

function showError(text) {
  const box = $('tree-error');
  box.hidden = !text;
  box.textContent = text || '';
}

function nodeLabel(n, clock) {
  const age = clock - n.last_access;
  const shared = n.num_children >= 2;
  const text = JSON.stringify(n.text).slice(1, -1) + (n.text_cut ? '…' : '');
  return el('span', { class: 'node-label' },
    el('code', { class: 'node-text', title: 'the edge\'s first tokens, decoded', text }),
    el('span', { class: 'tag', title: 'tokens on this edge (prefix length from the root)', text: `${fmtInt(n.num_tokens)} tok (prefix ${fmtInt(n.prefix_len)})` }),
    el('span', { class: n.lock_ref > 0 ? 'tag locked' : 'tag', title: 'running requests holding this prefix (protected from eviction)', text: `lock ${n.lock_ref}` }),
    el('span', { class: 'tag', title: 'the tree\'s logical LRU clock: eviction takes the oldest unlocked leaf first', text: `last access ${n.last_access} (${age} ago)` }),
    shared ? el('span', { class: 'tag shared', title: 'a prefix shared by several continuations', text: `shared by ${n.num_children}` }) : null,
    n.children_cut ? el('span', { class: 'tag cut', text: `${n.children_cut} not shown` }) : null);
}

function build(tree) {
  const kids = new Map();
  for (const n of tree.nodes) {
    if (!kids.has(n.parent)) kids.set(n.parent, []);
    kids.get(n.parent).push(n);
  }
  const render = (n) => {
    const children = kids.get(n.id) || [];
    const attrs = { class: 'tree-node', 'data-node-id': n.id, 'data-children': n.num_children, 'data-tokens': n.num_tokens, 'data-lock': n.lock_ref };
    if (!children.length) return el('div', { ...attrs, class: 'tree-node leaf' }, nodeLabel(n, tree.clock));
    return el('details', { ...attrs, open: true }, el('summary', {}, nodeLabel(n, tree.clock)),
      el('div', { class: 'tree-children' }, ...children.map(render)));
  };
  return (kids.get(0) || []).map(render);
}

export async function refreshTree() {
  if (controller) controller.abort();
  controller = new AbortController();
  let q = `max_nodes=${encodeURIComponent($('tree-max-nodes').value)}&max_depth=${encodeURIComponent($('tree-max-depth').value)}`;
  if (config.dp_size > 1) q += `&dp_rank=${encodeURIComponent($('tree-dp-rank').value)}`;  // each replica has its own cache
  showError('');
  try {
    const tree = await getJSON(`/debug/radix_tree?${q}`, controller.signal);
    const root = $('tree-root');
    if (!tree.enabled) {
      root.replaceChildren(el('p', { class: 'muted', text: 'The radix cache is off (--disable-radix-cache): nothing is shared.' }));
    } else if (!tree.nodes.length) {
      root.replaceChildren(el('p', { class: 'muted', text: 'The tree is empty: no prefix is cached yet.' }));
    } else {
      root.replaceChildren(...build(tree));
    }
    $('tree-summary').textContent = `${config.dp_size > 1 ? `replica ${tree.dp_rank}: ` : ''}${fmtInt(tree.total_tokens)} cached tokens (${fmtInt(tree.locked_tokens)} locked, `
      + `${fmtInt(tree.evictable_tokens)} evictable) · ${tree.nodes.length} nodes shown${tree.truncated ? ' (cut: raise max nodes / depth)' : ''}`;
    root.dataset.loaded = String(Date.now());
  } catch (err) {
    if (!isAbort(err)) showError(err.message || String(err));
  }
}

export function initTree() {
  if (config.dp_size > 1) {
    $('tree-dp-label').hidden = false;
    $('tree-dp-rank').max = String(config.dp_size - 1);
    $('tree-dp-rank').addEventListener('change', refreshTree);
  }
  $('tree-refresh').addEventListener('click', refreshTree);
  $('tree-expand').addEventListener('click', () => { for (const d of document.querySelectorAll('#tree-root details')) d.open = true; });
  $('tree-collapse').addEventListener('click', () => { for (const d of document.querySelectorAll('#tree-root details')) d.open = false; });
}
