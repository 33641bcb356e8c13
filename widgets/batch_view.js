/*
 * batch_view.js: BatchView's frontend, a compact table of a run_batch. Draws from synced traits only (a saved
 * notebook shows the finished batch); redraws at most once per animation frame; text goes in via textContent.
 *
 * Traits:
 *   title: string (the program's name)
 *   columns: string[] (the arguments' names, then the variables', in the order they appeared)
 *   rows: Row[] (the first 200 programs of the batch, in batch order)
 *   summary: { total, queued, running, done, error, interrupted, cancelled, gens, tokens, shown, arguments: int
 *              (how many of `columns` are arguments), elapsed: seconds }
 * Row = { i, program: id | null, arguments: {name: repr}, status: "queued" | "running" | "done" | "error" |
 *         "interrupted" | "cancelled", values: {variable: text}, gens, gens_done, tokens, error, elapsed }
 */

const BV_CSS = `
.sgnb-bv { font: 12px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #222);
  max-width: 100%; }
.sgnb-bv-head { display: flex; flex-wrap: wrap; gap: 2px 10px; align-items: center; margin: 2px 0 5px; }
.sgnb-bv-sum { color: var(--jp-ui-font-color2, #666); }
.sgnb-bv-progress { width: 160px; height: 7px; border-radius: 4px; background: var(--jp-layout-color3, #e3e5e8);
  overflow: hidden; display: flex; }
.sgnb-bv-progress > span { height: 100%; }
.sgnb-bv-progress .done { background: #1f9d3a; } .sgnb-bv-progress .error { background: #d93025; }
.sgnb-bv-progress .running { background: #2764d8; opacity: .55; }
.sgnb-bv-scroll { max-height: 340px; overflow: auto; border: 1px solid var(--jp-border-color2, #d0d7de); border-radius: 5px; }
.sgnb-bv table { border-collapse: collapse; width: 100%; }
.sgnb-bv th { position: sticky; top: 0; background: var(--jp-layout-color2, #f3f4f6); font-weight: 600;
  color: var(--jp-ui-font-color2, #555); text-align: left; padding: 2px 7px; white-space: nowrap; }
.sgnb-bv td { padding: 1px 7px; border-top: 1px solid var(--jp-border-color2, #eee); vertical-align: top;
  max-width: 220px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.sgnb-bv td.val { font: 11.5px var(--jp-code-font-family, ui-monospace, monospace); }
.sgnb-bv td.num { text-align: right; color: var(--jp-ui-font-color2, #555); }
.sgnb-bv th.var { color: var(--jp-ui-font-color1, #222); }
.sgnb-bv-status { font-weight: 600; }
.sgnb-bv-status.running { color: #2764d8; } .sgnb-bv-status.done { color: #1f9d3a; }
.sgnb-bv-status.error { color: #d93025; } .sgnb-bv-status.interrupted, .sgnb-bv-status.cancelled { color: #b06000; }
.sgnb-bv-status.queued { color: var(--jp-ui-font-color3, #999); font-weight: 400; }
.sgnb-bv-more { color: var(--jp-ui-font-color2, #666); padding: 3px 7px; }
`;

function bel(tag, cls, parent, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (parent) parent.appendChild(e);
  return e;
}

function drawBatch(model, root) {
  const rows = model.get("rows") || [];
  const cols = model.get("columns") || [];
  const s = model.get("summary") || {};
  const nargs = s.arguments ?? 0;
  const frag = document.createDocumentFragment();
  const head = bel("div", "sgnb-bv-head", frag);
  bel("b", null, head, `run_batch${model.get("title") ? ": " + model.get("title") : ""}`);
  const total = Math.max(s.total || 0, 1);
  const bar = bel("span", "sgnb-bv-progress", head);
  for (const k of ["done", "error", "running"]) {
    const n = k === "error" ? (s.error || 0) + (s.interrupted || 0) + (s.cancelled || 0) : s[k] || 0;
    bel("span", k, bar).style.width = `${(100 * n) / total}%`;
  }
  bar.title = `${s.done ?? 0} done, ${s.running ?? 0} running, ${s.queued ?? 0} queued of ${s.total ?? 0}`;
  const parts = [`${(s.done || 0) + (s.error || 0) + (s.interrupted || 0)}/${s.total ?? 0} finished`];
  if (s.running) parts.push(`${s.running} running`);
  if (s.error) parts.push(`${s.error} failed`);
  if (s.interrupted || s.cancelled) parts.push(`${(s.interrupted || 0) + (s.cancelled || 0)} interrupted`);
  parts.push(`${s.gens ?? 0} gens, ${s.tokens ?? 0} tokens`, `${(s.elapsed ?? 0).toFixed(1)} s`);
  bel("span", "sgnb-bv-sum", head, parts.join(" · "));
  const scroll = bel("div", "sgnb-bv-scroll", frag);
  const table = bel("table", null, scroll);
  const tr = bel("tr", null, table);
  bel("th", null, tr, "#");
  bel("th", null, tr, "status");
  cols.forEach((c, j) => { bel("th", j < nargs ? "arg" : "var", tr, c).title = j < nargs ? "argument" : "variable"; });
  for (const h of ["gens", "tokens", "s"]) bel("th", null, tr, h);
  for (const r of rows) {
    const row = bel("tr", null, table);
    row.dataset.status = r.status;
    bel("td", "num", row, r.i);
    const st = bel("td", `sgnb-bv-status ${r.status}`, row, r.status);
    if (r.error) st.title = r.error;
    cols.forEach((c, j) => {
      const v = j < nargs ? r.arguments?.[c] : r.values?.[c];
      const td = bel("td", j < nargs ? "arg" : "val", row, v ?? "");
      if (v) td.title = v;
    });
    bel("td", "num", row, r.gens ? `${r.gens_done}/${r.gens}` : "");
    bel("td", "num", row, r.tokens || "");
    bel("td", "num", row, typeof r.elapsed === "number" ? r.elapsed.toFixed(r.elapsed < 10 ? 2 : 1) : "");
  }
  if ((s.total ?? 0) > rows.length) bel("div", "sgnb-bv-more", scroll, `… ${s.total - rows.length} more programs (counted above, not listed)`);
  root.replaceChildren(frag);
}

function render({ model, el: host }) {
  const wrap = bel("div", "sgnb-bv", host);
  bel("style", null, wrap, BV_CSS);
  const root = bel("div", null, wrap);
  let frame = 0;
  const update = () => {
    if (frame) return;
    const run = () => {
      frame = 0;
      drawBatch(model, root);
    };
    frame = typeof requestAnimationFrame === "function" ? requestAnimationFrame(run) : setTimeout(run, 16);
  };
  drawBatch(model, root);
  const keys = ["rows", "columns", "summary", "title"];
  for (const k of keys) model.on(`change:${k}`, update);
  return () => {
    for (const k of keys) model.off(`change:${k}`, update);
    wrap.remove();
  };
}

export default { render };
