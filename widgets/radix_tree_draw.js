/*
 * radix_tree_draw.js: draws sgnb's radix tree. Shared by the RadixTreeView widget (radix_tree.js) and the
 * JupyterLab side panel: a plain ES module with no imports and no dependencies.
 *
 *   import { drawTree } from "./radix_tree_draw.js";
 *   const handle = drawTree(container, state, callbacks, options);  // the first call builds the DOM inside
 *                                                          // `container` (and reads `options`)
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
 * A node row:  { id: int, parent: int | null, text: string (its tokens decoded, maybe cut: drawn shortened;
 *                an image's or video's tokens read "[image]" / "[video]", once each),
 *                tokens: int, hits: int, locked: bool (in use by a running request),
 *                state: "" | "new" | "hit" | "evicted", rids: int (requests known to share it),
 *                kids: int (children in the tree), collapsed?: true, hidden?: int (descendants folded),
 *                media?: Media[] (the images / videos in its tokens, in order: drawn as thumbnail chips
 *                before the label, at most two and a "+N") }
 * Media:       { kind: "image" | "video", hash: string (short content hash), tokens: int (its tokens in this
 *                node), thumbnail: "data:image/...;base64,..." | "" | null }
 * A group row: { id: "g<parent id>", parent: int, group: true, children: int (hidden children of parent),
 *                count: int (nodes in their subtrees), tokens: int, new: int, hit: int, evicted: int,
 *                state: the most notable state inside ("new" > "hit" > "evicted" > "") }
 * details:     { id, text (the node's full text), prefix (text of the path above it; its start is cut when
 *                prefix_truncated), prefix_truncated: bool, tokens, hits, locked, state,
 *                rids: string[] (newest first, at most 32), n_rids: int, depth_tokens: int (tokens root..node),
 *                media?: Media[] (larger thumbnails, shown in the details box) }
 *
 * callbacks = {             all optional
 *   select(id | null),      a node was clicked (null: clicked again, the selection is cleared)
 *   toggle(id),             a node's fold button was clicked: fold or unfold its subtree
 *   expandGroup(parentId),  a "+N nodes" group was clicked: show the hidden children of parentId
 * }
 * Without callbacks the drawing still folds and selects on its own (e.g. a saved notebook with no kernel).
 *
 * options = {               read once, when the first call builds the view; all optional
 *   fit: false,             "fit width" starts on: when the tree's columns (one per level, 210px each) are
 *                           wider than the scroll box, it is drawn as an outline instead (one row per node,
 *                           a narrow indent per level, boxes as wide as what is left, labels cut to fit);
 *                           only a tree too deep even for that scrolls sideways. Redrawn on a resize.
 *   follow: false,          "follow newest" starts on: whenever a newer node appears (node ids grow with
 *                           every insert and split), it is scrolled into view and outlined with dashes
 *   controls: true,         show the two toggles in the header (the user can flip them either way)
 * }
 * The root element's data-layout ("columns" | "outline") and data-newest (the newest node's id) say what
 * was drawn.
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
const OUTLINE_ROW_H = BOX_H + 4;
const OUTLINE_MIN_BOX_W = 120; // narrower boxes than this scroll sideways instead
const INDENT_MIN = 8;
const INDENT_MAX = 22;
const CHAR_W = 6.4; // average width of an 11px label character, for cutting labels to a box
const CHIP = 28; // a media chip: a square thumbnail at the box's left
const CHIP_GAP = 3;
const MAX_CHIPS = 2; // more media in one node: a "+N" chip after these

const TREE_CSS = `
.sgnb-rt { font: 12px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #222); }
.sgnb-rt-head { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: center; margin: 2px 0 6px; }
.sgnb-rt-sum { font-weight: 600; }
.sgnb-rt-legend span { display: inline-flex; align-items: center; gap: 4px; margin-right: 10px; }
.sgnb-rt-legend i { width: 11px; height: 11px; border-radius: 2px; display: inline-block; border: 1px solid; }
.sgnb-rt-ctl { display: inline-flex; gap: 10px; color: var(--jp-ui-font-color2, #666); }
.sgnb-rt-ctl label { display: inline-flex; align-items: center; gap: 3px; cursor: pointer; }
.sgnb-rt-ctl input { margin: 0; }
.sgnb-rt-scroll { max-height: 460px; overflow: auto; border: 1px solid var(--jp-border-color2, #ddd);
  border-radius: 4px; background: var(--jp-layout-color0, #fff); scrollbar-gutter: stable; }
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
.sgnb-rt.following .sgnb-rt-node.newest rect.box { stroke-dasharray: 5 2; stroke-width: 2.2; }
.sgnb-rt-node .fold { fill: #fff; stroke: #8a9099; }
.sgnb-rt-chip rect { fill: #e4e7eb; stroke: #57606a; stroke-width: 1; rx: 3; ry: 3; }
.sgnb-rt-chip.video rect { fill: #1f2328; stroke: #1f2328; }
.sgnb-rt-node .sgnb-rt-chip text { font-size: 9px; fill: #57606a; }
.sgnb-rt-node .sgnb-rt-chip.video text { fill: #fff; }
.sgnb-rt-node text.foldmark { font-size: 11px; font-weight: 700; }
@keyframes sgnb-rt-fade { from { opacity: 1; } to { opacity: 0.3; } }
.sgnb-rt-details { margin-top: 6px; padding: 6px 8px; border: 1px solid var(--jp-border-color2, #ddd);
  border-radius: 4px; background: var(--jp-layout-color1, #fafafa); }
.sgnb-rt-details:empty { display: none; }
.sgnb-rt-details pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; max-height: 220px;
  overflow: auto; font: 12px var(--jp-code-font-family, monospace); }
.sgnb-rt-details .prefix { color: var(--jp-ui-font-color2, #777); }
.sgnb-rt-details .own { background: #fff3b0; color: #1f2328; }
.sgnb-rt-media { display: flex; flex-wrap: wrap; gap: 8px; margin: 4px 0; }
.sgnb-rt-media figure { margin: 0; font-size: 10.5px; color: var(--jp-ui-font-color2, #666); }
.sgnb-rt-media img { display: block; max-height: 96px; max-width: 160px; border-radius: 3px;
  border: 1px solid var(--jp-border-color2, #ccc); }
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
  return s.length > n ? s.slice(0, Math.max(n - 1, 0)) + "…" : s;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : /(ch|sh|s|x)$/.test(word) ? "es" : "s"}`;
}

function toggle(parent, name, label, on, onChange) {
  const item = htmlEl("label", null, parent);
  const box = htmlEl("input", null, item);
  box.type = "checkbox";
  box.name = name;
  box.checked = on;
  box.addEventListener("change", () => onChange(box.checked));
  htmlEl("span", null, item, label);
  return box;
}

function createTreeView(container, options) {
  const opts = options || {};
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
  const ctl = htmlEl("span", "sgnb-rt-ctl", head);
  if (opts.controls === false) ctl.style.display = "none";
  const scroll = htmlEl("div", "sgnb-rt-scroll", root);
  const svg = svgEl("svg", { width: 10, height: 10 }, scroll);
  const edges = svgEl("path", { class: "sgnb-rt-edges", d: "" }, svg);
  const layer = svgEl("g", {}, svg);
  const empty = htmlEl("div", "sgnb-rt-empty", scroll, "");
  const details = htmlEl("div", "sgnb-rt-details", root);
  const view = {
    container, root, sum, scroll, svg, edges, layer, empty, details,
    els: new Map(), state: { nodes: [] }, callbacks: {}, frame: 0,
    localCollapsed: null, localSelected: undefined,
    fit: !!opts.fit, follow: !!opts.follow, followed: null, shape: "", width: 0, resize: null,
  };
  toggle(ctl, "fit", "fit width", view.fit, (on) => {
    view.fit = on;
    schedule(view);
  });
  toggle(ctl, "follow", "follow newest", view.follow, (on) => {
    view.follow = on;
    view.followed = null; // bring the newest node into view now
    schedule(view);
  });
  if (typeof ResizeObserver === "function") {
    // the outline is cut to the box's width: draw again when it changes (a panel resized, a scrollbar came)
    view.resize = new ResizeObserver(() => {
      if (view.fit && scroll.clientWidth !== view.width) schedule(view);
    });
    view.resize.observe(scroll);
  }
  view.handle = {
    destroy() {
      if (view.frame) cancelFrame(view.frame);
      view.frame = 0;
      if (view.resize) view.resize.disconnect();
      root.remove();
      TREE_VIEWS.delete(container);
    },
  };
  return view;
}

const requestFrame = (cb) => (typeof requestAnimationFrame === "function" ? requestAnimationFrame(cb) : setTimeout(cb, 16));
const cancelFrame = (h) => (typeof cancelAnimationFrame === "function" ? cancelAnimationFrame(h) : clearTimeout(h));

/** Draw (or update) the tree in `container`; see the top of this file for `state` and `callbacks`. */
export function drawTree(container, state, callbacks = {}, options = {}) {
  let view = TREE_VIEWS.get(container);
  if (!view) {
    view = createTreeView(container, options);
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

function childrenOf(rows) {
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
  return { kids, rootRow };
}

/** Positions: x by depth, y by leaf order, a parent centred on its children. Folded subtrees are skipped. */
function layoutTree(rows, collapsed) {
  const { kids, rootRow } = childrenOf(rows);
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

/** Outline positions: one row per node in pre-order (a "+N nodes" group after its shown siblings), x by
 * depth. Folded subtrees are skipped. */
function layoutOutline(rows, collapsed) {
  const { kids, rootRow } = childrenOf(rows);
  const pos = new Map();
  if (!rootRow) return { pos, depth: 0, slots: 0 };
  let slot = 0;
  let maxDepth = 0;
  const stack = [[rootRow, 0]];
  while (stack.length) {
    const [row, depth] = stack.pop();
    maxDepth = Math.max(maxDepth, depth);
    pos.set(row.id, { x: depth, y: slot++, row });
    if (collapsed.has(row.id)) continue;
    const children = kids.get(row.id) || [];
    const ordered = [...children.filter((c) => !c.group), ...children.filter((c) => c.group)];
    for (let i = ordered.length - 1; i >= 0; i--) stack.push([ordered[i], depth + 1]);
  }
  return { pos, depth: maxDepth, slots: slot };
}

/** Where each row goes: in columns when they fit in `avail` pixels or `fit` is off, else in an outline whose
 * indent shrinks with the depth. Returns { mode, boxes: Map id -> {px, py, w, p}, width, height,
 * edge(parentBox, childBox, parentRow) -> SVG path }. */
function arrange(rows, collapsed, fit, avail) {
  const cols = layoutTree(rows, collapsed);
  const colW = BOX_W + GAP_X;
  const colsWidth = (cols.depth + 1) * colW + 16;
  if (!fit || !(avail > 0) || colsWidth <= avail) {
    const rowH = BOX_H + GAP_Y;
    const boxes = new Map();
    for (const [id, p] of cols.pos) boxes.set(id, { px: 6 + p.x * colW, py: 4 + p.y * rowH, w: BOX_W, p });
    return {
      mode: "columns", boxes, width: colsWidth, height: Math.max(cols.slots, 1) * rowH + 8,
      edge(a, b, parentRow) {
        const x0 = a.px + BOX_W + (parentRow.kids ? 8 : 0);
        const y0 = a.py + BOX_H / 2;
        const y1 = b.py + BOX_H / 2;
        const xm = (x0 + b.px) / 2;
        return `M${x0},${y0}C${xm},${y0} ${xm},${y1} ${b.px},${y1}`;
      },
    };
  }
  const out = layoutOutline(rows, collapsed);
  const room = avail - 12; // 6px margins
  const indent = Math.max(INDENT_MIN, Math.min(INDENT_MAX,
    Math.floor((room - OUTLINE_MIN_BOX_W) / Math.max(out.depth, 1))));
  const boxes = new Map();
  let width = 0;
  for (const [id, p] of out.pos) {
    const px = 6 + p.x * indent;
    const w = Math.max(OUTLINE_MIN_BOX_W, 6 + room - px);
    boxes.set(id, { px, py: 4 + p.y * OUTLINE_ROW_H, w, p });
    width = Math.max(width, px + w + 6);
  }
  return {
    mode: "outline", boxes, width, // = avail, unless the deepest boxes hit their minimum width
    height: Math.max(out.slots, 1) * OUTLINE_ROW_H + 8,
    edge(a, b) {
      const x = a.px + Math.floor(indent / 2); // a vertical from under the parent, then across to the child
      return `M${x},${a.py + BOX_H}V${b.py + BOX_H / 2}H${b.px}`;
    },
  };
}

function nodeElements(view, id) {
  let e = view.els.get(id);
  if (e) return e;
  const g = svgEl("g", { class: "sgnb-rt-node" }, view.layer);
  const title = svgEl("title", {}, g);
  const rect = svgEl("rect", { class: "box", width: BOX_W, height: BOX_H }, g);
  const chips = svgEl("g", { class: "chips" }, g);
  const t1 = svgEl("text", { x: 7, y: 15 }, g);
  const t2 = svgEl("text", { class: "sub", x: 7, y: 29 }, g);
  const lock = svgEl("g", { class: "lock" }, g);
  svgEl("path", { d: "M2.5,5 V3.5 a3,3 0 0 1 6,0 V5", fill: "none", stroke: "#444", "stroke-width": 1.4 }, lock);
  svgEl("rect", { x: 0.5, y: 5, width: 10, height: 7.5, rx: 1.5, fill: "#444" }, lock);
  const fold = svgEl("g", {}, g);
  svgEl("circle", { class: "fold", r: 7 }, fold);
  const foldMark = svgEl("text", { class: "foldmark", x: -3.5, y: 4 }, fold);
  e = { g, title, rect, chips, t1, t2, lock, fold, foldMark, id, geom: "", mediaSig: "", chipsW: 0 };
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

/** Box width and the fold button's place: outside the box on the right in columns (the edge to the
 * children starts there), inside its lower right corner in the outline. */
function setGeometry(e, w, outline) {
  const geom = `${w}${outline ? "o" : "c"}`;
  if (e.geom === geom) return;
  e.geom = geom;
  e.rect.setAttribute("width", String(w));
  e.lock.setAttribute("transform", `translate(${w - 16},5)`);
  const fold = outline ? `translate(${w - 10},${BOX_H - 10})` : `translate(${w + 1},${BOX_H / 2})`;
  e.fold.setAttribute("transform", fold);
}

/** A thumbnail's URL if it is a data: URL of an image, else "" (nothing else is drawn). */
function mediaUrl(x) {
  return typeof x === "string" && x.startsWith("data:image/") ? x : "";
}

function mediaLabel(m) {
  return `${m.kind === "video" ? "video" : "image"}${m.hash ? " " + m.hash : ""} · ${m.tokens ?? "?"} tok`;
}

/** A node's media chips at the box's left (rebuilt only when its media change): a thumbnail each (a label
 * when there is none), at most MAX_CHIPS, then "+N". Returns the x where the label starts. */
function drawChips(e, media) {
  const sig = media.map((m) => `${m.kind}:${m.hash}:${m.tokens}:${mediaUrl(m.thumbnail).length}`).join(",");
  if (e.mediaSig === sig) return e.chipsW || 7;
  e.mediaSig = sig;
  e.chips.replaceChildren();
  let x = 4;
  for (const m of media.slice(0, MAX_CHIPS)) {
    const video = m.kind === "video";
    const chip = svgEl("g", { class: `sgnb-rt-chip ${video ? "video" : "image"}`, transform: `translate(${x},4)` },
      e.chips);
    svgEl("rect", { width: CHIP, height: CHIP }, chip);
    const url = mediaUrl(m.thumbnail);
    if (url) {
      const img = svgEl("image", { x: video ? 3 : 1, y: 1, width: CHIP - (video ? 6 : 2), height: CHIP - 2,
        preserveAspectRatio: "xMidYMid meet" }, chip);
      img.setAttribute("href", url);
    } else {
      svgEl("text", { x: 4, y: 17 }, chip).textContent = video ? "vid" : "img";
    }
    x += CHIP + CHIP_GAP;
  }
  if (media.length > MAX_CHIPS) {
    svgEl("text", { class: "sub", x, y: 22 }, e.chips).textContent = `+${media.length - MAX_CHIPS}`;
    x += 18;
  }
  e.chipsW = media.length ? x + 2 : 7;
  return e.chipsW;
}

/** The sub line: "12 tok · 3 hits · 2 reqs" when it fits in `chars` characters, else "12t 3h 2r" (cut). */
function subLine(row, folded, chars) {
  const long = [`${row.tokens} tok`, plural(row.hits, "hit")];
  const short = [`${row.tokens}t`, `${row.hits}h`];
  if (row.rids) {
    long.push(plural(row.rids, "req"));
    short.push(`${row.rids}r`);
  }
  if (folded) {
    long.push(`+${row.hidden ?? "…"} folded`);
    short.push(`+${row.hidden ?? "…"}`);
  }
  const text = long.join(" · ");
  return { text: text.length <= chars ? text : shortText(short.join(" "), chars), full: long };
}

/** Scroll `scroll` so that the box at (x, y, w, h) is in view: centred vertically when it was not, and its
 * left part in view when it was not. */
function reveal(scroll, x, y, w, h) {
  const H = scroll.clientHeight;
  const W = scroll.clientWidth;
  if (y < scroll.scrollTop || y + h > scroll.scrollTop + H) scroll.scrollTop = Math.max(0, y - (H - h) / 2);
  if (x < scroll.scrollLeft || x + Math.min(w, W) > scroll.scrollLeft + W) {
    scroll.scrollLeft = Math.max(0, x - 6);
  }
}

function renderTree(view) {
  const state = view.state || {};
  const rows = Array.isArray(state.nodes) ? state.nodes : [];
  const collapsed = collapsedSet(view);
  const selected = selectedId(view);
  view.width = view.scroll.clientWidth;
  const plan = arrange(rows, collapsed, view.fit, view.width);
  const outline = plan.mode === "outline";
  view.svg.setAttribute("width", String(plan.width));
  view.svg.setAttribute("height", String(plan.height));
  view.root.dataset.layout = plan.mode;
  view.root.classList.toggle("following", view.follow);
  view.empty.textContent = rows.length ? "" : "(the radix tree is empty)";
  view.empty.style.display = rows.length ? "none" : "block";

  // the newest node: ids grow with every insert (and split), so the largest live one
  let newest = null;
  for (const { p } of plan.boxes.values()) {
    const row = p.row;
    if (!row.group && typeof row.id === "number" && row.parent !== null && row.parent !== undefined
        && row.state !== "evicted" && (newest === null || row.id > newest.id)) newest = row;
  }
  view.root.dataset.newest = newest ? String(newest.id) : "";

  const seen = new Set();
  let d = "";
  for (const box of plan.boxes.values()) {
    const row = box.p.row;
    const { px, py, w } = box;
    seen.add(row.id);
    const e = nodeElements(view, row.id);
    e.isGroup = !!row.group;
    e.parent = row.parent;
    setGeometry(e, w, outline);
    e.g.setAttribute("transform", `translate(${px},${py})`);
    const cls = ["sgnb-rt-node"];
    if (row.state) cls.push(row.state);
    if (row.locked) cls.push("locked");
    if (row.group) cls.push("group");
    if (row.parent === null || row.parent === undefined) cls.push("root");
    if (selected !== null && row.id === selected) cls.push("selected");
    if (newest !== null && row.id === newest.id) cls.push("newest");
    const media = !row.group && Array.isArray(row.media) ? row.media : [];
    if (media.length) cls.push("media");
    const clsText = cls.join(" ");
    if (e.g.getAttribute("class") !== clsText) e.g.setAttribute("class", clsText);
    // characters that fit: the box less its padding, the chips, the padlock and (in the outline) the fold button
    const textX = drawChips(e, media);
    if (e.t1.getAttribute("x") !== String(textX)) {
      e.t1.setAttribute("x", String(textX));
      e.t2.setAttribute("x", String(textX));
    }
    const chipChars = Math.ceil((textX - 7) / CHAR_W);
    const room = (outline ? Math.floor((w - 14 - 18) / CHAR_W) : LABEL_CHARS) - chipChars;
    if (row.group) {
      e.t1.textContent = shortText(`+${plural(row.count, "node")}`, room + 4);
      e.t2.textContent = shortText(`${row.tokens} tok in ${plural(row.children, "branch")}`, room + 4);
      e.title.textContent = `${row.count} nodes hidden (${row.new} new, ${row.hit} hit, ${row.evicted} evicted): click to show`;
      e.lock.style.display = "none";
      e.fold.style.display = "none";
    } else {
      const isRoot = row.parent === null || row.parent === undefined;
      e.t1.textContent = isRoot ? "root" : shortText(row.text, room);
      const sub = subLine(row, !!row.collapsed || collapsed.has(row.id), outline || media.length ? room : 99);
      e.t2.textContent = sub.text;
      const held = media.map((m) => `\n${mediaLabel(m)}`).join("");
      e.title.textContent = isRoot ? "root" : `${String(row.text ?? "")}\n(${sub.full.join(", ")})${held}`;
      e.lock.style.display = row.locked ? "" : "none";
      const foldable = (row.kids || 0) > 0 || collapsed.has(row.id);
      e.fold.style.display = foldable ? "" : "none";
      e.foldMark.textContent = collapsed.has(row.id) ? "+" : "−";
    }
    const parent = row.parent !== null && row.parent !== undefined ? plan.boxes.get(row.parent) : null;
    if (parent) d += plan.edge(parent, box, parent.p.row);
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
  // follow: a newer node, or the same one moved by a new layout (fit toggled, the box resized)
  const shape = `${plan.mode} ${plan.width}`;
  if (view.follow && newest !== null && (newest.id !== view.followed || shape !== view.shape)) {
    const b = plan.boxes.get(newest.id);
    reveal(view.scroll, b.px, b.py, b.w, BOX_H);
    view.followed = newest.id;
  }
  view.shape = shape;
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
  const media = d && Array.isArray(d.media) && d.media.length ? d.media : (row && Array.isArray(row.media) ? row.media : []);
  if (media.length) {
    const strip = htmlEl("div", "sgnb-rt-media", box);
    for (const m of media) {
      const fig = htmlEl("figure", null, strip);
      const url = mediaUrl(m.thumbnail);
      if (url) {
        const img = htmlEl("img", null, fig);
        img.src = url;
        img.alt = m.kind === "video" ? "video" : "image";
      }
      htmlEl("figcaption", null, fig, mediaLabel(m));
    }
  }
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
