/*
 * stats_draw.js: draws sgnb engine statistics with small SVG sparklines. Shared by the EngineStats widget
 * (engine_stats.js) and the JupyterLab side panel: a plain ES module with no imports.
 *
 *   import { drawStats } from "./stats_draw.js";
 *   const handle = drawStats(container, state);  // first call builds the DOM; later calls update it (one
 *                                                // requestAnimationFrame per burst of calls)
 *   handle.destroy();
 *
 * state = {
 *   stats: the latest Engine.get_stats() dict; used: cache_hit_rate (cumulative, 0..1), gen_tokens_per_s,
 *          prefill_tokens_per_s, kv_used, kv_cached, kv_total, kv_evictable, kv_protected, waiting, running,
 *          requests_finished, requests_aborted, retractions, model, device (missing fields show as 0 / "")
 *   history: { name: number[] } oldest first, one entry per change of the stats, names: hit_rate (per poll
 *          interval, 0..1), gen_tokens_per_s, prefill_tokens_per_s, kv_used_frac, kv_cached_frac (0..1),
 *          waiting, running
 * }
 * All text goes in through textContent.
 */

const STATS_NS = "http://www.w3.org/2000/svg";
const STATS_VIEWS = new WeakMap();
const SPARK_W = 132;
const SPARK_H = 30;

const STATS_CSS = `
.sgnb-st { font: 12px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #222); }
.sgnb-st-tiles { display: flex; flex-wrap: wrap; gap: 8px; }
.sgnb-st-tile { border: 1px solid var(--jp-border-color2, #ddd); border-radius: 5px; padding: 5px 8px;
  min-width: 140px; background: var(--jp-layout-color1, #fafafa); }
.sgnb-st-label { color: var(--jp-ui-font-color2, #666); font-size: 11px; }
.sgnb-st-value { font-size: 16px; font-weight: 600; margin: 1px 0 2px; }
.sgnb-st-note { color: var(--jp-ui-font-color2, #666); font-size: 11px; }
.sgnb-st svg polyline { fill: none; stroke-width: 1.5; }
.sgnb-st-foot { margin-top: 5px; color: var(--jp-ui-font-color2, #666); font-size: 11px; }
`;

// tile: label, value(stats), note(stats), lines: [series name, colour, fixed max or null]
const TILES = [
  ["cache hit rate", (s) => pct(s.cache_hit_rate), () => "number: since start · line: at each update",
    [["hit_rate", "#2764d8", 1]]],
  // idle, the live rate is 0: say so, and show the last rate seen while work ran instead of a bare 0.0
  ["decode tokens/s", (s, h) => (Number(s.gen_tokens_per_s) > 0 ? num(s.gen_tokens_per_s)
    : `idle (last ${num(lastActive(h.gen_tokens_per_s))})`),
  (s, h) => `prefill ${num(Number(s.prefill_tokens_per_s) > 0 ? s.prefill_tokens_per_s
    : lastActive(h.prefill_tokens_per_s))} tok/s${Number(s.prefill_tokens_per_s) > 0 ? "" : " (last)"}`,
  [["gen_tokens_per_s", "#1f9d3a", null], ["prefill_tokens_per_s", "#b26a00", null]]],
  ["KV pool", (s) => `${pct((s.kv_used || 0) / Math.max(s.kv_total || 0, 1))} used`,
    (s) => `${s.kv_used ?? 0}/${s.kv_total ?? 0} slots · ${s.kv_cached ?? 0} cached (${s.kv_evictable ?? 0} evictable)`,
    [["kv_used_frac", "#d93025", 1], ["kv_cached_frac", "#7b61ff", 1]]],
  ["queue", (s) => `${s.waiting ?? 0} waiting · ${s.running ?? 0} running`,
    (s) => `${s.requests_finished ?? 0} finished`, [["waiting", "#b26a00", null], ["running", "#1f9d3a", null]]],
];

function lastActive(series) {
  const xs = series || [];
  for (let i = xs.length - 1; i >= 0; i--) if (Number(xs[i]) > 0) return xs[i];
  return 0;
}

function pct(x) {
  return `${Math.round(100 * (Number(x) || 0))}%`;
}

function num(x) {
  const v = Number(x) || 0;
  return v >= 100 ? String(Math.round(v)) : v.toFixed(1);
}

function statsEl(tag, cls, parent, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;
  if (parent) parent.appendChild(el);
  return el;
}

/** The `points` attribute of a sparkline polyline for `values` (scaled to [0, max]). */
export function sparkPoints(values, max, width = SPARK_W, height = SPARK_H) {
  const vs = (values || []).map((v) => Number(v) || 0);
  if (!vs.length) return "";
  const top = max ?? Math.max(...vs, 1e-9);
  const step = vs.length > 1 ? width / (vs.length - 1) : 0;
  return vs.map((v, i) => `${(i * step).toFixed(1)},${(height - 1 - (Math.min(v, top) / top) * (height - 2)).toFixed(1)}`).join(" ");
}

function createStatsView(container) {
  const root = statsEl("div", "sgnb-st", container);
  statsEl("style", null, root, STATS_CSS);
  const tiles = statsEl("div", "sgnb-st-tiles", root);
  const parts = TILES.map(([label, , , lines]) => {
    const tile = statsEl("div", "sgnb-st-tile", tiles);
    statsEl("div", "sgnb-st-label", tile, label);
    const value = statsEl("div", "sgnb-st-value", tile, "");
    const svg = document.createElementNS(STATS_NS, "svg");
    svg.setAttribute("width", String(SPARK_W));
    svg.setAttribute("height", String(SPARK_H));
    tile.appendChild(svg);
    const polys = lines.map(([, colour]) => {
      const p = document.createElementNS(STATS_NS, "polyline");
      p.setAttribute("stroke", colour);
      svg.appendChild(p);
      return p;
    });
    const note = statsEl("div", "sgnb-st-note", tile, "");
    return { value, polys, note };
  });
  const foot = statsEl("div", "sgnb-st-foot", root, "");
  const view = { root, parts, foot, state: {}, frame: 0 };
  view.handle = {
    destroy() {
      if (view.frame) (typeof cancelAnimationFrame === "function" ? cancelAnimationFrame : clearTimeout)(view.frame);
      root.remove();
      STATS_VIEWS.delete(container);
    },
  };
  return view;
}

function renderStats(view) {
  const s = view.state.stats || {};
  const h = view.state.history || {};
  TILES.forEach(([, value, note, lines], i) => {
    const part = view.parts[i];
    part.value.textContent = value(s, h);
    part.note.textContent = note(s, h);
    lines.forEach(([name, , max], j) => part.polys[j].setAttribute("points", sparkPoints(h[name], max)));
  });
  const foot = [`model ${s.model ?? "?"} on ${s.device ?? "?"}`, `${s.requests_aborted ?? 0} aborted`,
    `${s.retractions ?? 0} retractions`, `${s.decode_steps ?? 0} decode steps`];
  view.foot.textContent = foot.join(" · ");
}

/** Draw (or update) the statistics in `container`; see the top of this file for `state`. */
export function drawStats(container, state) {
  let view = STATS_VIEWS.get(container);
  if (!view) {
    view = createStatsView(container);
    STATS_VIEWS.set(container, view);
  }
  view.state = state || {};
  if (!view.frame) {
    const run = () => {
      view.frame = 0;
      renderStats(view);
    };
    view.frame = typeof requestAnimationFrame === "function" ? requestAnimationFrame(run) : setTimeout(run, 16);
  }
  return view.handle;
}
