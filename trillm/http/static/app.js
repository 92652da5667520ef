// trillm's chat page: streamed chat through the server's own /v1/chat/completions, conversations
// kept in this browser (localStorage), nothing built at install. Stop closes the stream, which
// aborts the request on the server and frees its KV blocks before the next step.
'use strict';

const STORE = { conversations: 'trillm.conversations', current: 'trillm.current', settings: 'trillm.settings',
                key: 'trillm.apiKey' };
const $ = (id) => document.getElementById(id);
const state = {
  conversations: JSON.parse(localStorage.getItem(STORE.conversations) || '[]'),
  current: localStorage.getItem(STORE.current),
  settings: JSON.parse(localStorage.getItem(STORE.settings) || '{}'),
  controller: null, // the running answer's AbortController
};
for (const c of state.conversations) { // an answer the page was closed during ended there
  for (const m of c.messages) if (m.streaming) Object.assign(m, { streaming: false, stats: { stopped: true } });
}

function save() {
  localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
  localStorage.setItem(STORE.current, state.current || '');
  localStorage.setItem(STORE.settings, JSON.stringify(state.settings));
}

function conversation() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const c = { id: `${Date.now()}-${Math.random().toString(16).slice(2)}`, title: 'New chat', messages: [] };
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  return c;
}

// --- the server --------------------------------------------------------------------------------
async function api(path, init = {}, retried = false) {
  const headers = { 'Content-Type': 'application/json', ...(init.headers || {}) };
  const key = localStorage.getItem(STORE.key);
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401 && !retried) {
    const entered = await askKey();
    if (entered) {
      localStorage.setItem(STORE.key, entered);
      return api(path, init, true);
    }
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

// The key, asked in the page's own dialog (a browser's prompt() would block the page).
function askKey() {
  const dialog = $('key-dialog');
  $('api-key').value = '';
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener('close', () => resolve($('api-key').value.trim()), { once: true });
  });
}

async function loadModels() {
  const select = $('model');
  const models = (await (await api('/v1/models')).json()).data;
  select.replaceChildren(...models.map((m) => {
    const option = document.createElement('option');
    option.value = m.id;
    option.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
    return option;
  }));
  if (models.some((m) => m.id === state.settings.model)) select.value = state.settings.model;
}

// Server-sent events: each `data:` line's JSON, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split('\n')) {
        if (!line.startsWith('data: ')) continue;
        const data = line.slice(6);
        if (data === '[DONE]') return;
        yield JSON.parse(data);
      }
    }
  }
}

// --- rendering ---------------------------------------------------------------------------------
function markdown(text) {
  const html = DOMPurify.sanitize(marked.parse(text || ''));
  const box = document.createElement('div');
  box.innerHTML = html;
  for (const pre of box.querySelectorAll('pre')) {
    const button = document.createElement('button');
    button.type = 'button';
    button.className = 'copy-code';
    button.textContent = 'Copy';
    button.addEventListener('click', () => copy(pre.querySelector('code')?.textContent ?? pre.textContent, button));
    pre.append(button);
  }
  return box;
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) { // no clipboard API outside secure contexts: the older way
    const area = Object.assign(document.createElement('textarea'), { value: text });
    document.body.append(area);
    area.select();
    document.execCommand('copy');
    area.remove();
  }
  const label = button.textContent;
  button.textContent = 'Copied';
  setTimeout(() => { button.textContent = label; }, 1200);
}

function actionButton(label, onClick) {
  const button = document.createElement('button');
  button.type = 'button';
  button.textContent = label;
  button.className = label.toLowerCase();
  button.addEventListener('click', onClick);
  return button;
}

function statsText(stats) {
  if (!stats) return '';
  const parts = [];
  if (stats.completion_tokens != null) parts.push(`${stats.completion_tokens} tokens`);
  if (stats.tokens_per_second != null) parts.push(`${stats.tokens_per_second.toFixed(1)} tok/s`);
  if (stats.prompt_tokens != null) parts.push(`prompt ${stats.prompt_tokens} tokens`);
  if (stats.stopped) parts.push('stopped');
  return parts.join(' · ');
}

function messageElement(message, index, last) {
  const element = document.createElement('div');
  element.className = `message ${message.role}`;
  element.dataset.index = index;
  const role = document.createElement('div');
  role.className = 'role';
  role.textContent = message.role;
  element.append(role);
  if (message.reasoning) {
    const details = document.createElement('details');
    details.className = 'reasoning';
    details.open = Boolean(message.streaming);
    const summary = document.createElement('summary');
    summary.textContent = message.streaming ? 'Thinking…' : 'Reasoning';
    details.append(summary, Object.assign(document.createElement('div'), { textContent: message.reasoning }));
    element.append(details);
  }
  const content = markdown(message.content);
  content.className = 'content';
  element.append(content);
  const stats = document.createElement('div');
  stats.className = 'stats';
  stats.textContent = statsText(message.stats);
  element.append(stats);
  if (!message.streaming) {
    const actions = document.createElement('div');
    actions.className = 'actions';
    actions.append(actionButton('Copy', (event) => copy(message.content, event.target)));
    if (message.role === 'user') actions.append(actionButton('Edit', () => edit(index)));
    if (message.role === 'assistant' && last) actions.append(actionButton('Regenerate', regenerate));
    element.append(actions);
  }
  return element;
}

function render() {
  const list = $('conversations');
  list.replaceChildren(...state.conversations.map((c) => {
    const item = document.createElement('li');
    item.className = c.id === state.current ? 'current' : '';
    const open = actionButton(c.title, () => { state.current = c.id; save(); render(); });
    open.className = 'open';
    const remove = actionButton('×', () => {
      state.conversations = state.conversations.filter((other) => other.id !== c.id);
      if (state.current === c.id) state.current = state.conversations[0]?.id || null;
      save();
      render();
    });
    remove.className = 'delete';
    remove.title = 'Delete this conversation';
    item.append(open, remove);
    return item;
  }));
  const messages = conversation()?.messages || [];
  $('messages').replaceChildren(...messages.map((m, i) => messageElement(m, i, i === messages.length - 1)));
  $('messages').scrollTop = $('messages').scrollHeight;
  const busy = state.controller !== null;
  $('send').hidden = busy;
  $('stop').hidden = !busy;
}

function showError(message) {
  $('error').textContent = message || '';
  $('error').hidden = !message;
}

// --- talking -----------------------------------------------------------------------------------
function requestBody(c) {
  const s = state.settings;
  const history = c.messages.filter((m) => !m.streaming).map((m) => ({ role: m.role, content: m.content }));
  const system = (s.system || '').trim();
  const body = {
    model: $('model').value, stream: true, stream_options: { include_usage: true },
    messages: system ? [{ role: 'system', content: system }, ...history] : history,
  };
  for (const [name, parse] of [['temperature', parseFloat], ['top_p', parseFloat], ['max_tokens', parseInt]]) {
    const value = parse(s[name]);
    if (!Number.isNaN(value)) body[name] = value;
  }
  return body;
}

async function generate() {
  const c = conversation();
  const answer = { role: 'assistant', content: '', reasoning: '', streaming: true, stats: null };
  const body = requestBody(c);
  c.messages.push(answer);
  state.controller = new AbortController();
  showError('');
  render();
  let first = null;
  let usage = null;
  let frame = 0;
  try {
    const response = await api('/v1/chat/completions', {
      method: 'POST', body: JSON.stringify(body), signal: state.controller.signal,
    });
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      if ((delta.content || delta.reasoning_content) && first === null) first = performance.now();
      answer.content += delta.content || '';
      answer.reasoning += delta.reasoning_content || '';
      if (!frame) frame = requestAnimationFrame(() => { frame = 0; render(); });
    }
  } catch (error) {
    if (error.name !== 'AbortError') showError(error.message);
  } finally {
    const stopped = state.controller?.signal.aborted;
    const seconds = first === null ? 0 : (performance.now() - first) / 1000;
    answer.streaming = false;
    answer.stats = usage
      ? { completion_tokens: usage.completion_tokens, prompt_tokens: usage.prompt_tokens,
          tokens_per_second: seconds > 0 && usage.completion_tokens > 1 ? (usage.completion_tokens - 1) / seconds : null }
      : { stopped: Boolean(stopped) };
    state.controller = null;
    save();
    render();
  }
}

async function send(text) {
  const c = conversation() || newConversation();
  if (c.messages.length === 0) c.title = text.slice(0, 40);
  c.messages.push({ role: 'user', content: text });
  save();
  await generate();
}

function regenerate() {
  const c = conversation();
  if (state.controller || c.messages.at(-1)?.role !== 'assistant') return;
  c.messages.pop();
  generate();
}

function edit(index) {
  if (state.controller) return;
  const c = conversation();
  const element = $('messages').querySelector(`[data-index="${index}"]`);
  const area = Object.assign(document.createElement('textarea'), { value: c.messages[index].content, rows: 3 });
  element.classList.add('editing');
  element.replaceChildren(area, actionButton('Save & send', () => {
    c.messages = c.messages.slice(0, index);
    c.messages.push({ role: 'user', content: area.value });
    save();
    generate();
  }), actionButton('Cancel', render));
  area.focus();
}

// --- wiring ------------------------------------------------------------------------------------
function bindSetting(name) {
  const input = $(name);
  if (state.settings[name] !== undefined) input.value = state.settings[name];
  input.addEventListener('input', () => { state.settings[name] = input.value; save(); });
}

window.addEventListener('DOMContentLoaded', async () => {
  ['system', 'temperature', 'top_p', 'max_tokens'].forEach(bindSetting);
  $('model').addEventListener('change', () => { state.settings.model = $('model').value; save(); });
  $('settings-toggle').addEventListener('click', () => {
    $('settings').hidden = !$('settings').hidden;
    $('settings-toggle').setAttribute('aria-expanded', String(!$('settings').hidden));
  });
  $('forget-key').addEventListener('click', () => localStorage.removeItem(STORE.key));
  $('new-chat').addEventListener('click', () => { if (!state.controller) { newConversation(); render(); } });
  $('composer').addEventListener('submit', (event) => {
    event.preventDefault();
    const text = $('prompt').value.trim();
    if (!text || state.controller) return;
    $('prompt').value = '';
    send(text);
  });
  $('prompt').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey) {
      event.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => state.controller?.abort());
  render();
  try {
    await loadModels();
  } catch (error) {
    showError(error.message);
  }
});
