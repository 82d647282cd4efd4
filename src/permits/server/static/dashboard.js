// permits dashboard. No libraries and no build step. Names, owners, keys and reasons are arbitrary
// strings, so data only ever reaches the DOM through textContent and attributes, never as HTML.
const KEY = 'permits.token';
const TYPES = ['grant', 'end', 'capacity', 'admin'];
const CAP = 500;
const DASH = '–';
const enc = encodeURIComponent;
const $ = (id) => document.getElementById(id);

let me = null; // the /v1/whoami answer while signed in
let view = { dead: true, timers: [], stops: [] };
let feed = []; // last CAP events, newest first, collected on every page
let lastId = null;
let streamCtl = null;
let loadAlert = '';
let dlg = null; // context of the open dialog
let clocks = [];
const ui = { filter: '', types: new Set(TYPES), paused: false, frozen: [], missed: 0 };
const ann = { pending: 0, last: -1e9, timer: 0 };

// --- DOM helpers

function h(tag, props = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k === 'text') e.textContent = v;
    else if (k === 'on') for (const ev in v) e.addEventListener(ev, v[ev]);
    else e.setAttribute(k, v === true ? '' : v);
  }
  e.append(...kids.flat(9).filter((x) => x != null && x !== false && x !== ''));
  return e;
}

function s(tag, attrs = {}, ...kids) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  e.append(...kids);
  return e;
}

// Replace a box's content without losing keyboard focus or horizontal scroll: elements that can
// hold focus carry data-fk, a key that survives re-rendering.
function swap(box, ...nodes) {
  const a = document.activeElement;
  const fk = box.contains(a) ? a.dataset.fk : null;
  const left = box.querySelector('.scroll')?.scrollLeft;
  box.replaceChildren(...nodes.flat().filter(Boolean));
  if (left) { const sc = box.querySelector('.scroll'); if (sc) sc.scrollLeft = left; }
  if (fk) findFk(fk, box)?.focus();
}
const findFk = (fk, root = document) => [...root.querySelectorAll('[data-fk]')].find((e) => e.dataset.fk === fk);

const num = (v, d = 1) => (v == null || !isFinite(v) ? DASH : (+v).toLocaleString(undefined, { maximumFractionDigits: d }));
const str = (v) => (v == null ? DASH : typeof v === 'object' ? JSON.stringify(v) : String(v));

function time(iso, short) {
  if (iso == null) return DASH;
  const d = new Date(iso);
  if (isNaN(d)) return String(iso);
  const utc = d.toISOString();
  return h('time', { datetime: utc, title: utc, text: short ? d.toLocaleTimeString() : d.toLocaleString() });
}

function dur(x) {
  if (x == null || !isFinite(x)) return DASH;
  if (x < 60) return `${num(x, x < 10 ? 1 : 0)} s`;
  const m = Math.floor(x / 60);
  return m < 60 ? `${m} min ${Math.floor(x % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

const badge = () => h('span', { class: 'badge', text: 'FULL' });

// cols: [[key, label, class?]]; rows: [[trAttrs, cells]]. Each td gets data-col, and data-label for
// the stacked-card layout on narrow screens. Explicit roles keep table semantics when CSS reflows it.
function table(attrs, caption, cols, rows, empty) {
  const body = rows.length
    ? rows.map(([ta, cells]) => h('tr', { ...ta, role: 'row' }, cells.map((c, i) => {
      const td = c instanceof HTMLTableCellElement ? c : h('td', {}, c);
      const [col, label, cls] = cols[i];
      Object.assign(td.dataset, { col, label });
      td.setAttribute('role', 'cell');
      if (cls) td.classList.add(cls);
      return td;
    })))
    : h('tr', { role: 'row' }, h('td', { role: 'cell', colspan: cols.length, class: 'empty', text: empty }));
  return h('div', { class: 'scroll' }, h('table', { ...attrs, class: 'data', role: 'table' },
    h('caption', { text: caption }),
    h('thead', { role: 'rowgroup' }, h('tr', { role: 'row' },
      cols.map(([, label, cls]) => h('th', { scope: 'col', role: 'columnheader', class: cls, text: label })))),
    h('tbody', { role: 'rowgroup' }, body)));
}

// --- API

// The token lives in this tab (sessionStorage), or on this device (localStorage) when the user asks.
const token = {
  get: () => sessionStorage.getItem(KEY) || localStorage.getItem(KEY),
  set: (t, remember) => { sessionStorage.setItem(KEY, t); if (remember) localStorage.setItem(KEY, t); },
  forget: () => { sessionStorage.removeItem(KEY); localStorage.removeItem(KEY); },
};

function authHeaders(extra) {
  const t = token.get();
  return t ? { ...extra, Authorization: `Bearer ${t}` } : extra;
}

async function api(path, { method = 'GET', body, signal } = {}) {
  const headers = authHeaders({ Accept: 'application/json' });
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const r = await fetch(path, { method, headers, signal, cache: 'no-store', body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { /* not JSON: keep the status line */ }
  if (!r.ok) {
    const err = new Error(data?.error?.message || `${r.status} ${r.statusText}`.trim());
    err.status = r.status;
    if (r.status === 401) needToken();
    throw err;
  }
  return data;
}

function setAlert(msg) { const a = $('alert'); if (a.textContent !== msg) a.textContent = msg; }
function setStatus(msg) { $('status').textContent = msg; }
function report(e) {
  if (!e || e.name === 'AbortError' || e.status === 401) return;
  loadAlert = e.message;
  setAlert(e.message);
}
function loadOk() { if (loadAlert && $('alert').textContent === loadAlert) setAlert(''); loadAlert = ''; }

// Runs load() at most once per `gap` ms, never twice at once; kick(delay) asks for a run.
function refresher(v, load, gap) {
  let last = -1e9, timer = 0, busy = false, again = false;
  const run = async () => {
    timer = 0;
    if (v.dead) return;
    if (busy) { again = true; return; }
    busy = true;
    last = performance.now();
    try { await load(); loadOk(); } catch (e) { report(e); }
    busy = false;
    if (again) { again = false; kick(); }
  };
  const kick = (delay = 0) => {
    if (!timer && !v.dead) timer = setTimeout(run, Math.max(delay, last + gap - performance.now()));
  };
  v.stops.push(() => clearTimeout(timer));
  return kick;
}

function every(v, ms, fn) { v.timers.push(setInterval(() => document.hidden || fn(), ms)); }

// --- sign in

async function boot() {
  let who;
  try {
    who = await api('/v1/whoami');
  } catch (e) {
    if (e.status !== 401) { setAlert(`Cannot reach the service: ${e.message}`); setTimeout(boot, 5000); }
    return;
  }
  me = who;
  $('signin').hidden = true;
  setAlert('');
  $('whoami').textContent = `${who.identity} (${who.admin ? 'admin' : 'read-only'})`;
  $('sign-out').hidden = !token.get();
  $('live-status').hidden = false;
  startStream();
  route(false);
}

function needToken() {
  const had = token.get();
  token.forget();
  me = null;
  stopStream();
  teardown();
  document.querySelectorAll('dialog[open]').forEach((d) => d.close());
  $('view').replaceChildren();
  $('whoami').textContent = '';
  $('sign-out').hidden = true;
  $('live-status').hidden = true;
  $('signin').hidden = false;
  if (had) setAlert('The token was not accepted. Please sign in again.');
  $('token').focus();
}

// --- live feed

function setLive(on) {
  const el = $('live-status');
  el.textContent = on ? 'Live' : 'Reconnecting…';
  el.dataset.state = on ? 'live' : 'down';
}

function stopStream() { streamCtl?.abort(); streamCtl = null; setLive(false); }
function startStream() { stopStream(); streamCtl = new AbortController(); streamLoop(streamCtl.signal); }

const sleep = (ms, signal) => new Promise((res) => {
  const t = setTimeout(res, ms);
  signal.addEventListener('abort', () => { clearTimeout(t); res(); }, { once: true });
});

async function streamLoop(signal) {
  let backoff = 1000, first = true;
  while (!signal.aborted) {
    const conn = new AbortController();
    const drop = () => conn.abort();
    signal.addEventListener('abort', drop, { once: true });
    try {
      if (lastId == null) lastId = (await api('/v1/events', { signal })).cursor;
      const r = await fetch(`/v1/events/stream?since=${enc(lastId ?? '')}`, {
        headers: authHeaders({ Accept: 'text/event-stream' }), signal: conn.signal, cache: 'no-store',
      });
      if (r.status === 401) { needToken(); return; }
      if (!r.ok || !r.body) throw new Error(`stream: ${r.status}`);
      setLive(true);
      backoff = 1000;
      if (!first) view.refresh?.(); // catch up on whatever happened while disconnected
      first = false;
      await readSSE(r.body, conn);
    } catch { /* fall through to reconnect */ }
    signal.removeEventListener('abort', drop);
    if (signal.aborted) return;
    setLive(false);
    await sleep(backoff, signal);
    backoff = Math.min(backoff * 2, 15000);
  }
}

async function readSSE(body, conn) {
  const reader = body.getReader();
  const dec = new TextDecoder();
  let buf = '', data = [], type = '', id = null, watchdog = 0;
  // The server pings every 15 s; silence for much longer means a dead connection that TCP hasn't noticed.
  const arm = () => { clearTimeout(watchdog); watchdog = setTimeout(() => conn.abort(), 45000); };
  try {
    for (arm(); ; arm()) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += dec.decode(value, { stream: true });
      // A chunk ending in "\r" may be the first half of "\r\n": keep it for the next round.
      const cut = buf.endsWith('\r') ? buf.length - 1 : buf.length;
      const lines = buf.slice(0, cut).split(/\r\n|\r|\n/);
      buf = lines.pop() + buf.slice(cut);
      for (const line of lines) {
        if (line === '') {
          if (id != null) lastId = id;
          if (data.length) onStreamEvent(type, data.join('\n'));
          data = []; type = ''; id = null;
          continue;
        }
        if (line[0] === ':') continue;
        const i = line.indexOf(':');
        const field = i < 0 ? line : line.slice(0, i);
        let val = i < 0 ? '' : line.slice(i + 1);
        if (val[0] === ' ') val = val.slice(1);
        if (field === 'data') data.push(val);
        else if (field === 'event') type = val;
        else if (field === 'id' && !val.includes('\0')) id = val;
      }
    }
  } finally {
    clearTimeout(watchdog);
    reader.cancel().catch(() => {});
  }
}

const sent = new Set();
function onStreamEvent(type, raw) {
  let d;
  try { d = JSON.parse(raw); } catch { return; }
  if (!d || typeof d !== 'object') return;
  d.type = d.type || type;
  if (!TYPES.includes(d.type)) { view.refresh?.(); return; } // summary/resync etc.: just reload the page data
  // The feed may repeat an event (it re-reads a short overlap, and a page that joins catches up on its own
  // while the instance's poller reads for every page): show each once, by its id.
  const key = d.lease_id ?? d.change_id ?? d.admin_id;
  if (key != null) {
    const id = `${d.type}:${key}`;
    if (sent.has(id)) return;
    sent.add(id);
    if (sent.size > 4 * CAP) sent.delete(sent.values().next().value);
  }
  // Newest first by the database's time: a grant is listed a moment after it happened (see the feed's
  // docs), so it may arrive after an ending or a change that came later.
  const at = d.at_ms ?? 0;
  let i = 0;
  while (i < feed.length && (feed[i].at_ms ?? 0) > at) i++;
  feed.splice(i, 0, d);
  if (feed.length > CAP) feed.length = CAP;
  if (ui.paused) ui.missed++;
  view.onEvent?.(d);
}

// --- routing

function teardown() {
  view.dead = true;
  view.timers.forEach(clearInterval);
  view.stops.forEach((f) => f());
}

function route(focus) {
  if (!me) return;
  const hash = location.hash || '#/';
  if (!hash.startsWith('#/')) return; // e.g. "#main" from the skip link without JS
  teardown();
  const v = view = { dead: false, timers: [], stops: [], root: $('view') };
  setAlert('');
  let page = overviewPage, arg = null, title = 'Overview';
  if (hash.startsWith('#/s/')) {
    try { arg = decodeURIComponent(hash.slice(4)); } catch { arg = null; }
    if (arg) { page = semaphorePage; title = arg; }
  } else if (hash === '#/events') { page = eventsPage; title = 'Events'; }
  const cur = page === eventsPage ? '#/events' : page === overviewPage ? '#/' : null;
  for (const a of document.querySelectorAll('.top nav a')) {
    if (a.getAttribute('href') === cur) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  document.title = `${title} – permits`;
  v.root.replaceChildren();
  page(v, arg);
  if (focus) v.root.querySelector('h2')?.focus();
}

// --- charts

function stats(vals) {
  const xs = vals.filter((x) => x != null && isFinite(x));
  if (!xs.length) return null;
  return { avg: xs.reduce((a, b) => a + b, 0) / xs.length, peak: Math.max(...xs) };
}

// An SVG path through vals (null = gap), scaled into w x ht with 0..max on the y axis.
function pathFor(vals, w, ht, max) {
  let d = '', pen = false;
  const dx = vals.length > 1 ? w / (vals.length - 1) : 0;
  vals.forEach((v, i) => {
    if (v == null || !isFinite(v)) { pen = false; return; }
    const y = 1 + (1 - Math.min(Math.max(v, 0), max) / max) * (ht - 2);
    d += `${pen ? 'L' : 'M'}${(i * dx).toFixed(1)} ${y.toFixed(1)}`;
    if (!pen && vals[i + 1] == null) d += 'h0.5'; // a lone sample still shows as a dot
    pen = true;
  });
  return d || 'M0 0';
}

function spark(util) {
  const st = stats(util);
  const label = st ? `last hour: avg ${Math.round(st.avg * 100)} %, peak ${Math.round(st.peak * 100)} %` : 'last hour: no data';
  return s('svg', { class: 'spark', viewBox: '0 0 120 28', role: 'img' },
    s('title', {}, label), s('line', { x1: 0, y1: 27, x2: 120, y2: 27 }), s('path', { d: pathFor(util, 120, 28, 1) }));
}

function nice(x) {
  if (!(x > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= x);
}

const perMin = (v, step) => (v * 60) / step;
const CHARTS = [
  { title: 'Utilisation', unit: ' %', max: 100, series: [['util', 'in use', (v) => v * 100]] },
  { title: 'Wait time', unit: ' ms', series: [['wait_p50_ms', 'p50'], ['wait_p99_ms', 'p99']] },
  { title: 'Hold time', unit: ' ms', series: [['hold_p50_ms', 'p50'], ['hold_p99_ms', 'p99']] },
  { title: 'Refusals and timeouts', unit: ' /min', series: [['refused', 'refused', perMin], ['timeouts', 'timeouts', perMin]] },
];

function chart(def) {
  const svg = s('svg', { viewBox: '0 0 300 100', preserveAspectRatio: 'none', role: 'img' }, s('title', {}, `${def.title}: loading`));
  const legend = h('p', { class: 'legend' });
  const data = h('div');
  const fig = h('figure', { class: 'chart' }, h('figcaption', { text: def.title }), legend, svg,
    h('p', { class: 'axis', 'aria-hidden': 'true' }, h('span', { text: '60 min ago' }), h('span', { text: 'now' })),
    h('details', {}, h('summary', { text: 'Data' }), data));
  const fmt = (v) => (v == null ? 'no data' : `${num(v, v < 10 ? 1 : 0)}${def.unit}`);
  fig.update = (points, step) => {
    const cols = def.series.map(([key, label, f]) => ({
      key, label, vals: points.map((p) => (p[key] == null ? null : f ? f(p[key], step) : p[key])),
    }));
    const max = def.max || nice(stats(cols.flatMap((c) => c.vals))?.peak);
    const parts = cols.map((c) => { const st = stats(c.vals); return st && `${c.label} avg ${fmt(st.avg)}, peak ${fmt(st.peak)}`; }).filter(Boolean);
    svg.replaceChildren(s('title', {}, `${def.title}, last hour: ${parts.join('; ') || 'no data'}`),
      s('line', { x1: 0, y1: 50, x2: 300, y2: 50 }),
      ...cols.map((c, i) => s('path', { class: `s${i}`, d: pathFor(c.vals, 300, 100, max) })));
    legend.replaceChildren(...(cols.length > 1 ? cols.map((c, i) => h('span', { class: `key s${i}`, text: c.label })) : []),
      h('span', { text: `scale 0 to ${fmt(max)}` }));
    data.replaceChildren(table({}, `${def.title} per minute`, [['t', 'Minute'], ...cols.map((c) => [c.key, c.label])],
      points.map((p, j) => [{}, [time(p.t, true), ...cols.map((c) => fmt(c.vals[j]))]]), 'No data yet'));
  };
  return fig;
}

// --- countdowns

// Seconds left come from the server's clock (expires_in); elapsed time from performance.now(), so
// a wrong or changing client wall clock cannot distort them.
function countdown(td, secs, t0) {
  td.setAttribute('aria-live', 'off');
  const c = { td, secs, t0 };
  paint(c);
  if (secs != null) clocks.push(c);
  return td;
}
function paint(c) {
  if (c.secs == null) { c.td.textContent = DASH; return; }
  const left = c.secs - (performance.now() - c.t0) / 1000;
  c.td.textContent = left <= 0 ? 'expired' : `${Math.ceil(left)} s`;
}

// --- overview

function overviewPage(v) {
  const filter = h('input', { id: 'filter', type: 'search', autocomplete: 'off', spellcheck: 'false', 'aria-describedby': 'filter-hint', value: ui.filter });
  const summary = h('p', { id: 'summary' });
  const inst = h('p', { class: 'muted' });
  const box = h('div');
  let rows = [];
  v.root.append(
    h('h2', { tabindex: -1, text: 'Overview' }),
    h('div', { class: 'tools' },
      h('p', { class: 'field' }, h('label', { for: 'filter', text: 'Filter by name' }), filter,
        h('span', { id: 'filter-hint', class: 'muted', text: 'Names starting with this text.' })),
      me.admin && h('p', {}, h('button', { type: 'button', id: 'create-semaphore', 'data-fk': 'new', text: 'New semaphore…', on: { click: (e) => openCreate(e.currentTarget) } }))),
    h('section', {}, h('h3', { text: 'Semaphores' }), summary, inst, box));
  const cols = [['name', 'Name'], ['in_use', 'In use'], ['used', 'Used', 'n'], ['capacity', 'Capacity', 'n'], ['waiting', 'Waiting', 'n'],
    ['util', 'Last hour'], ['refused', 'Refused/min', 'n'], ['timeouts', 'Timeouts/min', 'n'], ['state', 'State']];
  const draw = () => {
    const list = rows.filter((x) => x.name.startsWith(ui.filter));
    const full = (x) => x.full ?? x.available === 0;
    summary.textContent = `${list.filter(full).length} of ${list.length} full`;
    swap(box, table({ id: 'semaphores' }, 'Semaphores: use now and over the last hour', cols, list.map((x) => {
      const f = full(x);
      const pct = x.capacity > 0 ? Math.min(1, x.used / x.capacity) : f ? 1 : 0;
      const fill = h('span');
      fill.style.width = `${pct * 100}%`; // CSSOM, allowed by the CSP (a style attribute would not be)
      return [{ 'data-name': x.name, class: f ? 'full' : null }, [
        h('a', { href: `#/s/${enc(x.name)}`, 'data-fk': `n:${x.name}`, text: x.name }),
        h('span', {}, h('span', { class: 'bar', 'aria-hidden': 'true' }, fill), `${x.used} / ${x.capacity}`),
        str(x.used), str(x.capacity), str(x.waiting ?? 0), spark(x.util || []),
        num(x.refused_per_min), num(x.timeouts_per_min), f ? badge() : 'ok',
      ]];
    }), ui.filter ? 'No semaphore names start with this text.' : 'No semaphores yet.'));
  };
  const kick = refresher(v, async () => {
    const d = await api(`/v1/overview?prefix=${enc(ui.filter)}`);
    if (v.dead) return;
    rows = d.semaphores || [];
    inst.textContent = d.instances != null ? `${d.instances} service instance${d.instances === 1 ? '' : 's'} reporting. Refusals, timeouts and waiting counts come from them only.` : '';
    draw();
  }, 1000);
  let t = 0;
  filter.addEventListener('input', () => {
    clearTimeout(t);
    t = setTimeout(() => { ui.filter = filter.value; draw(); kick(); }, 200);
  });
  v.stops.push(() => clearTimeout(t));
  every(v, 10000, kick);
  v.onEvent = () => kick();
  v.refresh = kick;
  kick();
}

// --- one semaphore

function semaphorePage(v, name) {
  const n = enc(name);
  // The boxes are drawn at once, with dashes until the first answer, so that the buttons below them do
  // not move under the pointer when it arrives.
  const factBoxes = (S, waiting) => [['Capacity', S?.capacity], ['Used', S?.used], ['Available', S?.available, S?.available === 0 && badge()],
    ['Waiting', S && waiting], ['Last token', S?.last_token], ['Fair', S && (S.fair ? 'yes' : 'no')]]
    .map(([k, val, extra]) => h('div', {}, h('dt', { text: k }), h('dd', { 'data-fact': k.toLowerCase().replace(' ', '_') }, str(val), extra && ' ', extra)));
  const facts = h('dl', { class: 'facts' }, factBoxes(null));
  const box = { holders: h('div'), waiters: h('div'), history: h('div'), endings: h('div'), log: h('div') };
  const charts = CHARTS.map(chart);
  const sec = (title, ...body) => h('section', {}, h('h3', { text: title }), body);
  let sem = null;
  v.root.append(
    h('h2', { id: 'semaphore-name', tabindex: -1, text: name }),
    facts,
    me.admin && h('p', { class: 'tools' },
      h('button', { type: 'button', id: 'change-capacity', 'data-fk': 'cap', text: 'Edit capacity…', on: { click: (e) => openDialog('capacity-dialog', e.currentTarget, { name }, (f) => { f.elements.namedItem('capacity').value = sem?.capacity ?? ''; }) } }),
      h('button', { type: 'button', id: 'delete-semaphore', 'data-fk': 'del', text: 'Delete…', on: { click: (e) => openDialog('delete-dialog', e.currentTarget, { name }) } })),
    sec('Holders', box.holders),
    sec('Waiters', box.waiters),
    sec('Last hour', h('p', { class: 'muted', text: 'Refusals, timeouts and wait times are counted by the service instances; clients that use the database directly are not included.' }),
      h('div', { class: 'charts' }, charts)),
    sec('Capacity history', box.history),
    sec('Recent endings', box.endings),
    sec('Admin log', box.log));

  const withT0 = (p) => p.then((d) => ({ ...d, t0: performance.now() }));
  const kick = refresher(v, async () => {
    const res = await Promise.allSettled([
      api(`/v1/semaphores/${n}`), withT0(api(`/v1/holders/${n}`)), withT0(api(`/v1/waiters/${n}`)),
      api(`/v1/capacity-history/${n}?limit=50`), api(`/v1/endings/${n}?limit=50`),
      api(`/v1/admin-log?name=${n}&limit=50`), api(`/v1/overview?prefix=${n}`),
    ]);
    if (v.dead) return;
    const [S, H, W, C, E, L, O] = res.map((r) => (r.status === 'fulfilled' ? r.value : null));
    sem = S;
    const waiting = O?.semaphores?.find((x) => x.name === name)?.waiting ?? W?.waiters?.length;
    swap(facts, factBoxes(S, waiting));
    if (H) renderHolders(H);
    if (S && W) renderWaiters(S, W, waiting);
    if (C) swap(box.history, table({ id: 'capacity-history' }, `Capacity changes of ${name}, newest first`,
      [['when', 'When'], ['who', 'Who'], ['change', 'Change'], ['reason', 'Reason']],
      (C.changes || []).map((c) => [{}, [time(c.changed_at), str(c.changed_by),
        `${c.old_capacity == null ? 'created' : c.old_capacity} → ${c.new_capacity}`, c.reason ?? '']]), 'No changes recorded.'));
    if (E) swap(box.endings, table({ id: 'endings' }, `Recent lease endings of ${name}, newest first`,
      [['ended', 'Ended'], ['owner', 'Owner'], ['key', 'Key'], ['count', 'Count', 'n'], ['token', 'Token', 'n'], ['held', 'Held', 'n'], ['reason', 'Reason'], ['note', 'Note']],
      (E.endings || []).map((x) => [{}, [time(x.ended_at), str(x.owner), hidden(x.key), str(x.count), str(x.token), dur(x.held_seconds), str(x.reason), x.note ?? '']]),
      'No endings recorded.'));
    if (L) swap(box.log, table({ id: 'admin-log' }, `Admin actions on ${name}, newest first`,
      [['at', 'When'], ['actor', 'Actor'], ['action', 'Action'], ['reason', 'Reason'], ['detail', 'Detail']],
      (L.entries || []).map((x) => [{}, [time(x.at), str(x.actor), str(x.action), x.reason ?? '', x.detail == null ? '' : str(x.detail)]]),
      'No admin actions recorded.'));
    const failed = res.slice(0, 6).find((r) => r.status === 'rejected');
    if (failed) throw failed.reason;
  }, 500);

  const hidden = (key) => key ?? h('span', { class: 'muted', text: 'hidden' });
  function renderHolders(H) {
    const cols = [['owner', 'Owner'], ['key', 'Key'], ['count', 'Count', 'n'], ['token', 'Token', 'n'], ['acquired', 'Acquired'], ['expires_in', 'Expires in', 'n']];
    if (me.admin) cols.push(['actions', 'Actions']);
    swap(box.holders, table({ id: 'holders' }, `Holders of ${name}`, cols, (H.holders || []).map((x) => [{ 'data-token': String(x.token) }, [
      str(x.owner), hidden(x.key), str(x.count), str(x.token), time(x.acquired_at), countdown(h('td'), x.expires_in, H.t0),
      me.admin && h('button', {
        type: 'button', class: 'force-release', 'data-fk': `rel:${x.token}`, disabled: x.key == null,
        on: { click: (e) => openDialog('revoke-dialog', e.currentTarget, { name, ...x }) },
      }, 'Force release', h('span', { class: 'sr-only', text: ` token ${x.token}` })),
    ].filter((c) => c !== false)]), 'No one holds a permit.'));
  }
  function renderWaiters(S, W, waiting) {
    const list = W.waiters || [];
    if (!S.fair) {
      swap(box.waiters, h('p', { text: 'Waiters are not queued on this semaphore (not fair)' }),
        waiting ? h('p', { text: `${waiting} request${waiting === 1 ? '' : 's'} waiting across the service instances.` }) : null);
    } else if (!list.length) swap(box.waiters, h('p', { text: 'No one is queued' }));
    else swap(box.waiters, table({ id: 'waiters' }, `Queue of ${name}, in ticket order`,
      [['ticket', 'Ticket', 'n'], ['owner', 'Owner'], ['key', 'Key'], ['count', 'Count', 'n'], ['since', 'Waiting since'], ['place_expires_in', 'Place expires in', 'n']],
      list.map((x) => [{}, [str(x.ticket), str(x.owner), hidden(x.key), str(x.count), time(x.waiting_since), countdown(h('td'), x.place_expires_in, W.t0)]]), ''));
  }

  const kickCharts = refresher(v, async () => {
    const d = await api(`/v1/stats/${n}?minutes=60`);
    if (!v.dead) charts.forEach((c) => c.update(d.points || [], d.step_seconds || 60));
  }, 1000);
  every(v, 5000, kick);
  every(v, 30000, kickCharts);
  v.onEvent = (d) => {
    if (!(d.names || [d.name]).includes(name)) return;
    if (d.type === 'end') {
      for (const p of d.permits || []) {
        if (p.name !== name) continue;
        for (const tr of box.holders.querySelectorAll('tr[data-token]')) if (tr.dataset.token === String(p.token)) tr.remove();
      }
    }
    kick(300);
  };
  v.refresh = () => { kick(); kickCharts(); };
  v.refresh();
}

// --- events

function eventItem(d) {
  const names = d.names?.length ? d.names : d.name != null ? [d.name] : [];
  const toks = (d.permits || []).map((p) => `${p.name} #${p.token}${p.count > 1 ? ` ×${p.count}` : ''}`).join(', ');
  const why = d.reason ? `reason “${d.reason}”` : null;
  const parts = {
    grant: [`owner ${d.owner}`, toks && `tokens ${toks}`],
    end: [`owner ${d.owner}`, toks && `tokens ${toks}`, d.reason && `reason ${d.reason}`, d.note],
    capacity: [`capacity ${d.old_capacity ?? 'created'} → ${d.new_capacity}`, d.changed_by && `by ${d.changed_by}`, why],
    admin: [d.action, d.actor && `by ${d.actor}`, why, d.detail != null && str(d.detail)],
  }[d.type] || [];
  return h('li', { 'data-type': d.type }, time(d.at, true), ' ', h('strong', { class: 'etype', text: d.type }), ' ',
    names.map((x, i) => [i ? ', ' : '', h('a', { href: `#/s/${enc(x)}`, text: x })]),
    parts.filter(Boolean).map((p) => ` · ${p}`).join(''));
}

function announce() {
  ann.pending++;
  if (ann.timer) return;
  ann.timer = setTimeout(() => {
    ann.timer = 0;
    ann.last = performance.now();
    $('announce').textContent = `${ann.pending} new event${ann.pending === 1 ? '' : 's'}`;
    ann.pending = 0;
  }, Math.max(0, ann.last + 10000 - performance.now()));
}

function eventsPage(v) {
  const list = h('ol', { id: 'events', class: 'events' });
  const empty = h('p', { class: 'muted', text: 'No events yet. They appear here as they happen.' });
  const note = h('span', { class: 'muted' });
  const shown = (d) => ui.types.has(d.type);
  const draw = () => {
    list.replaceChildren(...(ui.paused ? ui.frozen : feed).filter(shown).map(eventItem));
    empty.hidden = list.childElementCount > 0;
    note.textContent = ui.paused ? `Paused: ${ui.missed} new event${ui.missed === 1 ? '' : 's'} not shown.` : '';
  };
  const pause = h('button', {
    type: 'button', id: 'pause', 'aria-pressed': String(ui.paused), text: 'Pause',
    on: {
      click: () => {
        ui.paused = !ui.paused;
        pause.setAttribute('aria-pressed', String(ui.paused));
        ui.frozen = ui.paused ? feed.slice() : [];
        ui.missed = 0;
        draw();
      },
    },
  });
  v.root.append(
    h('h2', { tabindex: -1, text: 'Events' }),
    h('fieldset', {}, h('legend', { text: 'Show event types' }), TYPES.map((t) => h('label', {},
      h('input', { type: 'checkbox', name: 'type', value: t, checked: ui.types.has(t), on: { change: (e) => { ui.types[e.target.checked ? 'add' : 'delete'](t); draw(); } } }), t))),
    h('p', { class: 'tools' }, pause, note),
    h('section', {}, h('h3', { text: `Latest events, newest first (up to ${CAP})` }), empty, list));
  v.onEvent = (d) => {
    if (ui.paused) { note.textContent = `Paused: ${ui.missed} new event${ui.missed === 1 ? '' : 's'} not shown.`; return; }
    if (!shown(d)) return;
    // One redraw per frame, however many events a batch brings.
    if (!v.drawPending) {
      v.drawPending = true;
      requestAnimationFrame(() => { v.drawPending = false; if (!v.dead) draw(); });
    }
    announce();
  };
  v.stops.push(() => { clearTimeout(ann.timer); ann.timer = 0; ann.pending = 0; $('announce').textContent = ''; });
  draw();
}

// --- dialogs

function openDialog(id, opener, ctx, fill) {
  const d = $(id);
  const f = d.querySelector('form');
  f.reset();
  d.querySelector('.dlg-error').textContent = '';
  d.querySelectorAll('.dlg-name').forEach((e) => { e.textContent = ctx.name ?? ''; });
  dlg = { ...ctx, fk: opener.dataset.fk, opener };
  if (id === 'revoke-dialog') {
    $('revoke-what').textContent = `Lease of ${ctx.owner} on ${ctx.name} (token ${ctx.token}, key ${ctx.key}). Its holder loses the permit at once.`;
  }
  if (id === 'delete-dialog') confirmName();
  fill?.(f);
  d.showModal();
}
const openCreate = (opener) => openDialog('create-dialog', opener, {});

function confirmName() {
  const input = $('delete-confirm');
  input.setCustomValidity(input.value === dlg?.name ? '' : 'Type the name exactly as shown.');
}

function reason(f) {
  const r = f.elements.namedItem('reason').value.trim();
  if (!r) throw new Error('Please give a reason.');
  return r;
}

const ACTIONS = {
  'capacity-dialog': async (f, c) => {
    const capacity = Number(f.elements.namedItem('capacity').value);
    await api(`/v1/semaphores/${enc(c.name)}`, { method: 'PATCH', body: { capacity, reason: reason(f) } });
    return `Capacity of ${c.name} changed to ${capacity}.`;
  },
  'create-dialog': async (f) => {
    const name = f.elements.namedItem('name').value;
    await api('/v1/semaphores', {
      method: 'POST',
      body: { name, capacity: Number(f.elements.namedItem('capacity').value), fair: f.elements.namedItem('fair').checked, reason: reason(f) },
    });
    return `Created ${name}.`;
  },
  'delete-dialog': async (f, c) => {
    await api(`/v1/semaphores/${enc(c.name)}?force=${f.elements.namedItem('force').checked}&reason=${enc(reason(f))}`, { method: 'DELETE' });
    location.hash = '#/';
    return `Deleted ${c.name}.`;
  },
  'revoke-dialog': async (f, c) => {
    await api('/v1/leases/revoke', { method: 'POST', body: { key: c.key, owner: c.owner, reason: reason(f) } });
    return `Force-released token ${c.token} of ${c.owner}.`;
  },
};

function bindDialog(id) {
  const d = $(id);
  const f = d.querySelector('form');
  const err = d.querySelector('.dlg-error');
  f.addEventListener('submit', async (e) => {
    e.preventDefault(); // close only after the API call succeeded
    const btn = f.querySelector('[type=submit]');
    btn.disabled = true;
    err.textContent = '';
    const before = location.hash;
    try {
      const msg = await ACTIONS[id](f, dlg);
      d.close();
      setAlert('');
      setStatus(msg);
      if (location.hash === before) view.refresh?.();
    } catch (x) {
      err.textContent = x.message;
      setAlert(x.message);
    } finally {
      btn.disabled = false;
    }
  });
  d.querySelector('.cancel').addEventListener('click', () => d.close());
  d.addEventListener('close', () => {
    // The close event is queued: a dialog closed and opened again at once (Esc, then Enter on its
    // button) is open again by the time this runs, and the context belongs to the new opening.
    if (d.open) return;
    // The opener may have been re-rendered by a refresh while the dialog was open.
    const o = dlg?.opener?.isConnected ? dlg.opener : dlg?.fk && findFk(dlg.fk, $('view'));
    o?.focus();
    dlg = null;
  });
}

// --- start

Object.keys(ACTIONS).forEach(bindDialog);
$('delete-confirm').addEventListener('input', confirmName);
$('token-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const t = $('token').value.trim();
  if (!t) return;
  token.set(t, $('remember').checked);
  $('token').value = '';
  boot();
});
$('sign-out').addEventListener('click', () => {
  token.forget();
  me = null;
  feed = [];
  lastId = null;
  stopStream();
  teardown();
  setStatus('Signed out.');
  boot();
});
document.querySelector('.skip').addEventListener('click', (e) => { e.preventDefault(); $('main').focus(); });
addEventListener('hashchange', () => route(true));
document.addEventListener('visibilitychange', () => { if (!document.hidden) view.refresh?.(); });
setInterval(() => { clocks = clocks.filter((c) => c.td.isConnected); clocks.forEach(paint); }, 1000);
boot();
