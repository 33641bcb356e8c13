/*
 * radix_tree_draw.js: draws sgnb's radix tree. Shared by the RadixTreeView widget (radix_tree.js) and the
 * JupyterLab side panel: a plain ES module with no imports and no dependencies.
 *
 *   import { drawTree } from "./radix_tree_draw.js";
 *   const handle = drawTree(container, state, callbacks);  // first call builds the DOM inside `container`
 *   drawTree(container, nextState, callbacks);             // later calls update it; many calls in one frame
 *                                                          // are coalesced into one requestAnimationFrame
 *   handle.destroy();                                      // removes what it added and cancels a pending frame
 *
 * state = {
 *   nodes: Row[],           parents before children; exactly one row has parent === null (the root)
 *   summary: {              optional, all numbers: nodes (live nodes in the tree), shown (rows that are nodes),
 *                           groups ("+N" rows), tokens (cached tokens), locked (nodes in use), evicting (red
 *                           nodes still fading), new, hit (nodes coloured now), queued, finished (requests),
 *                           events (engine events seen), max_nodes (the row budget) }
 *   collapsed: id[],        nodes whose subtrees are folded (drawn with a "+" button and their hidden count)
 *   selected: id | null,    the clicked node: outlined, and described in the details box below the tree
 *   details: {...} | {},    the selected node as told by Python (see below); ignored when its id differs
 * }
 *
 * A node row:  { id: int, parent: int | null, text: string (its tokens decoded, maybe cut: drawn shortened),
 *                tokens: int, hits: int, locked: bool (in use by a running request),
 *                state: "" | "new" | "hit" | "evicted", rids: int (requests known to share it),
 *                kids: int (children in the tree), collapsed?: true, hidden?: int (descendants folded) }
 * A group row: { id: "g<parent id>", parent: int, group: true, children: int (hidden children of parent),
 *                count: int (nodes in their subtrees), tokens: int, new: int, hit: int, evicted: int,
 *                state: the most notable state inside ("new" > "hit" > "evicted" > "") }
 * details:     { id, text (the node's full text), prefix (text of the path above it; its start is cut when
 *                prefix_truncated), prefix_truncated: bool, tokens, hits, locked, state,
 *                rids: string[] (newest first, at most 32), n_rids: int, depth_tokens: int (tokens root..node) }
 *
 * callbacks = {             all optional
 *   select(id | null),      a node was clicked (null: clicked again, the selection is cleared)
 *   toggle(id),             a node's fold button was clicked: fold or unfold its subtree
 *   expandGroup(parentId),  a "+N nodes" group was clicked: show the hidden children of parentId
 * }
 * Without callbacks the drawing still folds and selects on its own (e.g. a saved notebook with no kernel).
 *
 * Colours follow the SGLang paper's figure: green = newly inserted, blue = hit in the latest step, red =
 * evicted (fading out). A padlock and a thick border mark nodes in use. All text goes in through textContent, never innerHTML.
 */

const SVG_NS = "http://www.w3.org/2000/svg";
const TREE_VIEWS = new WeakMap();
const BOX_W = 176;
const BOX_H = 36;
const GAP_X = 34;
const GAP_Y = 8;
const LABEL_CHARS = 26;

const TREE_CSS = `
.sgnb-rt { font: 12px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #222); }
.sgnb-rt-head { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: center; margin: 2px 0 6px; }
.sgnb-rt-sum { font-weight: 600; }
.sgnb-rt-legend span { display: inline-flex; align-items: center; gap: 4px; margin-right: 10px; }
.sgnb-rt-legend i { width: 11px; height: 11px; border-radius: 2px; display: inline-block; border: 1px solid; }
.sgnb-rt-scroll { max-height: 460px; overflow: auto; border: 1px solid var(--jp-border-color2, #ddd);
  border-radius: 4px; background: var(--jp-layout-color0, #fff); }
.sgnb-rt svg { display: block; }
.sgnb-rt-edges { fill: none; stroke: #9aa0a6; stroke-width: 1.2; }
.sgnb-rt-node { cursor: pointer; }
.sgnb-rt-node rect.box { fill: #f7f7f8; stroke: #8a9099; stroke-width: 1; rx: 5; ry: 5; }
.sgnb-rt-node text { fill: #1f2328; font-size: 11px; pointer-events: none; }
.sgnb-rt-node text.sub { fill: #57606a; font-size: 10px; }
.sgnb-rt-node.new rect.box { fill: #d3f4d1; stroke: #1f9d3a; stroke-width: 1.6; }
.sgnb-rt-node.hit rect.box { fill: #d5e5ff; stroke: #2764d8; stroke-width: 1.6; }
.sgnb-rt-node.evicted rect.box { fill: #ffd8d3; stroke: #d93025; stroke-width: 1.6; }
.sgnb-rt-node.evicted { animation: sgnb-rt-fade 1.5s ease-out forwards; }
.sgnb-rt-node.locked rect.box { stroke-width: 2.6; }
.sgnb-rt-node.root rect.box { fill: #eceff3; }
.sgnb-rt-node.group rect.box { fill: #fafafa; stroke-dasharray: 4 3; }
.sgnb-rt-node.selected rect.box { stroke: #9a32cd; stroke-width: 3; }
.sgnb-rt-node .fold { fill: #fff; stroke: #8a9099; }
.sgnb-rt-node text.foldmark { font-size: 11px; font-weight: 700; }
@keyframes sgnb-rt-fade { from { opacity: 1; } to { opacity: 0.3; } }
.sgnb-rt-details { margin-top: 6px; padding: 6px 8px; border: 1px solid var(--jp-border-color2, #ddd);
  border-radius: 4px; background: var(--jp-layout-color1, #fafafa); }
.sgnb-rt-details:empty { display: none; }
.sgnb-rt-details pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; max-height: 220px;
  overflow: auto; font: 12px var(--jp-code-font-family, monospace); }
.sgnb-rt-details .prefix { color: var(--jp-ui-font-color2, #777); }
.sgnb-rt-details .own { background: #fff3b0; color: #1f2328; }
.sgnb-rt-empty { padding: 12px; color: var(--jp-ui-font-color2, #777); }
`;

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (parent) parent.appendChild(el);
  return el;
}

function htmlEl(tag, cls, parent, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;
  if (parent) parent.appendChild(el);
  return el;
}

/** A label for a node's text: whitespace made visible, cut to `n` characters. */
export function shortText(text, n = LABEL_CHARS) {
  const s = String(text ?? "").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  return s.length > n ? s.slice(0, n - 1) + "…" : s;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function createTreeView(container) {
  const root = htmlEl("div", "sgnb-rt", container);
  htmlEl("style", null, root, TREE_CSS);
  const head = htmlEl("div", "sgnb-rt-head", root);
  const sum = htmlEl("span", "sgnb-rt-sum", head);
  const legend = htmlEl("span", "sgnb-rt-legend", head);
  for (const [label, fill, stroke] of [["new", "#d3f4d1", "#1f9d3a"], ["hit", "#d5e5ff", "#2764d8"],
    ["evicted", "#ffd8d3", "#d93025"]]) {
    const item = htmlEl("span", null, legend);
    const sw = htmlEl("i", null, item);
    sw.style.background = fill;
    sw.style.borderColor = stroke;
    htmlEl("span", null, item, label);
  }
  const inUse = htmlEl("span", null, legend);
  const lockSwatch = htmlEl("i", null, inUse);
  lockSwatch.style.borderWidth = "2.5px";
  lockSwatch.style.borderColor = "#444";
  htmlEl("span", null, inUse, "in use (locked)");
  const scroll = htmlEl("div", "sgnb-rt-scroll", root);
  const svg = svgEl("svg", { width: 10, height: 10 }, scroll);
  const edges = svgEl("path", { class: "sgnb-rt-edges", d: "" }, svg);
  const layer = svgEl("g", {}, svg);
  const empty = htmlEl("div", "sgnb-rt-empty", scroll, "");
  const details = htmlEl("div", "sgnb-rt-details", root);
  const view = {
    container, root, sum, svg, edges, layer, empty, details,
    els: new Map(), state: { nodes: [] }, callbacks: {}, frame: 0,
    localCollapsed: null, localSelected: undefined,
  };
  view.handle = {
    destroy() {
      if (view.frame) cancelFrame(view.frame);
      view.frame = 0;
      root.remove();
      TREE_VIEWS.delete(container);
    },
  };
  return view;
}

const requestFrame = (cb) => (typeof requestAnimationFrame === "function" ? requestAnimationFrame(cb) : setTimeout(cb, 16));
const cancelFrame = (h) => (typeof cancelAnimationFrame === "function" ? cancelAnimationFrame(h) : clearTimeout(h));

/** Draw (or update) the tree in `container`; see the top of this file for `state` and `callbacks`. */
export function drawTree(container, state, callbacks = {}) {
  let view = TREE_VIEWS.get(container);
  if (!view) {
    view = createTreeView(container);
    TREE_VIEWS.set(container, view);
  }
  view.state = state || { nodes: [] };
  view.callbacks = callbacks || {};
  // the model now speaks for folds and the selection: drop local guesses it has caught up with
  view.localCollapsed = null;
  view.localSelected = undefined;
  schedule(view);
  return view.handle;
}

function schedule(view) {
  if (!view.frame) {
    view.frame = requestFrame(() => {
      view.frame = 0;
      renderTree(view);
    });
  }
}

function collapsedSet(view) {
  return view.localCollapsed || new Set(view.state.collapsed || []);
}

function selectedId(view) {
  return view.localSelected !== undefined ? view.localSelected : (view.state.selected ?? null);
}

function onToggle(view, id) {
  const c = new Set(collapsedSet(view));
  if (c.has(id)) c.delete(id);
  else c.add(id);
  view.localCollapsed = c; // instant feedback; the model confirms (or not, with no kernel)
  if (view.callbacks.toggle) view.callbacks.toggle(id);
  schedule(view);
}

function onSelect(view, id) {
  const next = selectedId(view) === id ? null : id;
  view.localSelected = next;
  if (view.callbacks.select) view.callbacks.select(next);
  schedule(view);
}

function onGroup(view, parentId) {
  if (view.callbacks.expandGroup) view.callbacks.expandGroup(parentId);
}

/** Positions: x by depth, y by leaf order, a parent centred on its children. Folded subtrees are skipped. */
function layoutTree(rows, collapsed) {
  const kids = new Map();
  let rootRow = null;
  for (const r of rows) {
    if (r.parent === null || r.parent === undefined) {
      if (!rootRow) rootRow = r;
      continue;
    }
    if (!kids.has(r.parent)) kids.set(r.parent, []);
    kids.get(r.parent).push(r);
  }
  const pos = new Map();
  if (!rootRow) return { pos, depth: 0, slots: 0 };
  let slot = 0;
  let maxDepth = 0;
  // iterative post-order: a deep chain must not overflow the stack
  const stack = [[rootRow, 0, false]];
  while (stack.length) {
    const [row, depth, done] = stack.pop();
    const children = collapsed.has(row.id) ? [] : (kids.get(row.id) || []);
    if (!done && children.length) {
      stack.push([row, depth, true]);
      for (let i = children.length - 1; i >= 0; i--) stack.push([children[i], depth + 1, false]);
      continue;
    }
    maxDepth = Math.max(maxDepth, depth);
    let y;
    if (children.length) {
      const ys = children.map((c) => pos.get(c.id).y);
      y = (Math.min(...ys) + Math.max(...ys)) / 2;
    } else {
      y = slot++;
    }
    pos.set(row.id, { x: depth, y, row });
  }
  return { pos, depth: maxDepth, slots: slot };
}

function nodeElements(view, id) {
  let e = view.els.get(id);
  if (e) return e;
  const g = svgEl("g", { class: "sgnb-rt-node" }, view.layer);
  const title = svgEl("title", {}, g);
  const rect = svgEl("rect", { class: "box", width: BOX_W, height: BOX_H }, g);
  const t1 = svgEl("text", { x: 7, y: 15 }, g);
  const t2 = svgEl("text", { class: "sub", x: 7, y: 29 }, g);
  const lock = svgEl("g", { class: "lock", transform: `translate(${BOX_W - 16},5)` }, g);
  svgEl("path", { d: "M2.5,5 V3.5 a3,3 0 0 1 6,0 V5", fill: "none", stroke: "#444", "stroke-width": 1.4 }, lock);
  svgEl("rect", { x: 0.5, y: 5, width: 10, height: 7.5, rx: 1.5, fill: "#444" }, lock);
  const fold = svgEl("g", { transform: `translate(${BOX_W + 1},${BOX_H / 2})` }, g);
  svgEl("circle", { class: "fold", r: 7 }, fold);
  const foldMark = svgEl("text", { class: "foldmark", x: -3.5, y: 4 }, fold);
  e = { g, title, rect, t1, t2, lock, fold, foldMark, id };
  g.addEventListener("click", (ev) => {
    ev.stopPropagation();
    if (e.isGroup) onGroup(view, e.parent);
    else onSelect(view, e.id);
  });
  fold.addEventListener("click", (ev) => {
    ev.stopPropagation();
    onToggle(view, e.id);
  });
  view.els.set(id, e);
  return e;
}

function renderTree(view) {
  const state = view.state || {};
  const rows = Array.isArray(state.nodes) ? state.nodes : [];
  const collapsed = collapsedSet(view);
  const selected = selectedId(view);
  const { pos, depth, slots } = layoutTree(rows, collapsed);
  const colW = BOX_W + GAP_X;
  const rowH = BOX_H + GAP_Y;
  view.svg.setAttribute("width", String((depth + 1) * colW + 16));
  view.svg.setAttribute("height", String(Math.max(slots, 1) * rowH + 8));
  view.empty.textContent = rows.length ? "" : "(the radix tree is empty)";
  view.empty.style.display = rows.length ? "none" : "block";

  const seen = new Set();
  let d = "";
  for (const { x, y, row } of pos.values()) {
    seen.add(row.id);
    const px = 6 + x * colW;
    const py = 4 + y * rowH;
    const e = nodeElements(view, row.id);
    e.isGroup = !!row.group;
    e.parent = row.parent;
    e.g.setAttribute("transform", `translate(${px},${py})`);
    const cls = ["sgnb-rt-node"];
    if (row.state) cls.push(row.state);
    if (row.locked) cls.push("locked");
    if (row.group) cls.push("group");
    if (row.parent === null || row.parent === undefined) cls.push("root");
    if (selected !== null && row.id === selected) cls.push("selected");
    const clsText = cls.join(" ");
    if (e.g.getAttribute("class") !== clsText) e.g.setAttribute("class", clsText);
    if (row.group) {
      e.t1.textContent = `+${plural(row.count, "node")}`;
      e.t2.textContent = `${row.tokens} tok in ${plural(row.children, "branch")}`;
      e.title.textContent = `${row.count} nodes hidden (${row.new} new, ${row.hit} hit, ${row.evicted} evicted): click to show`;
      e.lock.style.display = "none";
      e.fold.style.display = "none";
    } else {
      const isRoot = row.parent === null || row.parent === undefined;
      e.t1.textContent = isRoot ? "root" : shortText(row.text);
      const sub = [`${row.tokens} tok`, plural(row.hits, "hit")];
      if (row.rids) sub.push(plural(row.rids, "req"));
      if (row.collapsed || collapsed.has(row.id)) sub.push(`+${row.hidden ?? "…"} folded`);
      e.t2.textContent = sub.join(" · ");
      e.title.textContent = isRoot ? "root" : `${String(row.text ?? "")}\n(${sub.join(", ")})`;
      e.lock.style.display = row.locked ? "" : "none";
      const foldable = (row.kids || 0) > 0 || collapsed.has(row.id);
      e.fold.style.display = foldable ? "" : "none";
      e.foldMark.textContent = collapsed.has(row.id) ? "+" : "−";
    }
    const parent = row.parent !== null && row.parent !== undefined ? pos.get(row.parent) : null;
    if (parent) {
      const x0 = 6 + parent.x * colW + BOX_W + (parent.row.kids ? 8 : 0);
      const y0 = 4 + parent.y * rowH + BOX_H / 2;
      const y1 = py + BOX_H / 2;
      const xm = (x0 + px) / 2;
      d += `M${x0},${y0}C${xm},${y0} ${xm},${y1} ${px},${y1}`;
    }
  }
  view.edges.setAttribute("d", d);
  for (const [id, e] of view.els) {
    if (!seen.has(id)) {
      e.g.remove();
      view.els.delete(id);
    }
  }
  renderSummary(view, state.summary || {}, rows);
  renderDetails(view, rows, selected, state.details || {});
}

function renderSummary(view, s, rows) {
  const nodes = s.nodes ?? rows.filter((r) => !r.group).length;
  const parts = [`${plural(Math.max(nodes - 1, 0), "node")} below the root`, `${s.tokens ?? 0} tokens cached`];
  if (s.locked) parts.push(`${s.locked} in use`);
  if (s.groups) parts.push(`showing ${s.shown} (+${s.groups} groups)`);
  if (s.evicting) parts.push(`${s.evicting} evicted`);
  if (s.queued) parts.push(`${s.queued} queued`);
  if (s.finished !== undefined) parts.push(`${s.finished} requests done`);
  view.sum.textContent = parts.join(" · ");
}

/** The text above `row` from the rows' own (maybe cut) labels: a fallback when Python sent no details. */
function pathText(rows, row) {
  const byId = new Map(rows.map((r) => [r.id, r]));
  const parts = [];
  for (let p = byId.get(row.parent); p && p.parent !== null && p.parent !== undefined; p = byId.get(p.parent)) {
    parts.push(String(p.text ?? ""));
    if (parts.length > 200) break;
  }
  return parts.reverse().join("");
}

function renderDetails(view, rows, selected, details) {
  const box = view.details;
  box.replaceChildren();
  if (selected === null || selected === undefined) return;
  const row = rows.find((r) => r.id === selected);
  const d = details && details.id === selected ? details : null;
  if (!row && !d) return;
  const tokens = d ? d.tokens : row.tokens;
  const hits = d ? d.hits : row.hits;
  const locked = d ? d.locked : row.locked;
  const head = [`node ${selected}`, `${tokens} tok`, plural(hits, "hit")];
  if (d && d.depth_tokens !== undefined) head.push(`${d.depth_tokens} tok from the root`);
  if (locked) head.push("in use (locked)");
  const st = d ? d.state : row.state;
  if (st) head.push(st);
  htmlEl("div", null, box, head.join(" · ")).style.fontWeight = "600";
  const pre = htmlEl("pre", null, box);
  if (d && d.prefix) htmlEl("span", "prefix", pre, (d.prefix_truncated ? "…" : "") + d.prefix);
  else if (!d && row) htmlEl("span", "prefix", pre, pathText(rows, row));
  htmlEl("span", "own", pre, d ? d.text : String(row.text ?? ""));
  const rids = d ? d.rids : null;
  const n = d ? d.n_rids : row.rids;
  const who = htmlEl("div", null, box);
  if (rids && rids.length) {
    who.textContent = `shared by ${plural(n, "request")}: ${rids.join(", ")}${n > rids.length ? ", …" : ""}`;
  } else {
    who.textContent = n ? `shared by ${plural(n, "request")}` : "no request recorded on this node yet";
  }
}
