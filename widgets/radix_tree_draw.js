/*
 * radix_tree_draw.js: draws sgnb's radix tree. Shared by the RadixTreeView widget (radix_tree.js) and the
 * JupyterLab side panel: a plain ES module with no imports and no dependencies. Both get their rows from the
 * same Python code (sgnb/widgets/_tree_rows.py).
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
 *                           groups ("+N" rows), tokens (cached tokens), locked (nodes in use), evicting (evicted
 *                           nodes still drawn), evicted_total (nodes evicted since the view began), new, hit
 *                           (nodes coloured now), max_hits (the most hit node's hits: the heat scale's top),
 *                           queued, finished (requests), events (engine events seen), max_nodes (the budget),
 *                           overview (true: the tree is larger than the budget and these rows are an overview
 *                           of it), folded (rows with "below") }
 *   collapsed: id[],        nodes whose subtrees are folded (drawn with a "+" button and their hidden count)
 *   selected: id | null,    the clicked node: outlined, and described in the details box below the tree
 *   details: {...} | {},    the selected node as told by Python (see below); ignored when its id differs
 * }
 *
 * A node row:  { id: int, parent: int | null, text: string (its tokens decoded, maybe cut; an image's or
 *                video's tokens read "[image]" / "[video]", once each; shown whole in the tooltip),
 *                label?: string (text as drawn, when it differs: each chat-template marker is one character
 *                of GLYPHS below, drawn as a small role chip), diff?: int (how many leading characters of
 *                the label it shares with a sibling's: a label too long for its box is cut so that the
 *                part after them shows), tokens: int, hits: int (cumulative), heat?: 1..5 (hits on the
 *                tree's log scale: the fill of a node with no live state), locked: bool (in use by a running
 *                request), state: "" | "new" | "hit" | "evicted", rids: int (requests known to share it),
 *                kids: int (children in the tree), collapsed?: true, hidden?: int (descendants folded),
 *                below?: int (descendants none of which is shown: a subtree the overview folded into this row;
 *                its "+" opens it through expandGroup), below_tokens?: int, below_state?: "new" | "hit" |
 *                "evicted" (the most notable state under it),
 *                media?: Media[] (the images / videos in its tokens, in order: drawn as thumbnail chips
 *                before the label, at most two and a "+N"), think?: "all" | "part" (how much of it is a
 *                reasoning model's thinking: its label's reasoning text is drawn apart from the answer's),
 *                think_inside?: true (it starts inside a reasoning block an ancestor opened) }
 * Media:       { kind: "image" | "video", hash: string (short content hash), tokens: int (its tokens in this
 *                node), thumbnail: "data:image/...;base64,..." | "" | null }
 * A group row: { id: "g<parent id>", parent: int, group: true, children: int (hidden children of parent),
 *                count: int (nodes in their subtrees), tokens: int, leaves: int (hidden children that are
 *                leaves), shapes: int (distinct subtree shapes among them), like_shown: bool (siblings of
 *                their shape are drawn: "+N more like these"), new: int, hit: int, evicted: int,
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
 *                           every insert and split), it is scrolled into view and outlined with dashes (one
 *                           column of its path kept on its left in columns)
 *   zoom: false,            "zoom to fit" starts on: the drawing is scaled down (to 20% at most) so that all
 *                           of it fits the scroll box
 *   controls: true,         show the toggles in the header (the user can flip them either way)
 * }
 * The root element's data-layout ("columns" | "outline"), data-newest (the newest node's id), data-zoom (the
 * scale drawn at), data-live ("1" while some node is new or hit) and data-root-pinned say what was drawn.
 *
 * The root stays in view: while its box is scrolled out of the scroll box (following a node deep down a big
 * tree, or scrolled by hand), a copy of its row is pinned over the box's top-left corner (data-root-pinned="1";
 * `.sgnb-rt-pin`), and a click on it scrolls back to the root.
 *
 * Colours: green = newly inserted, blue = hit in the latest step, red and dashed = evicted (drawn for a while,
 * then gone); with no live change, a node is shaded by its cumulative hits (the heat scale in the legend; while
 * something is live the heat is muted so the change stands out). A padlock and a thick border mark nodes in use.
 * Every colour comes from JupyterLab's theme variables (light fallbacks elsewhere), so a dark theme reads well.
 * All text goes in through textContent, never innerHTML.
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
const MIN_ZOOM = 0.2;
const HEAT_LEVELS = 5;
const GLYPH_CHARS = 3; // a role chip is about as wide as three characters
const GLYPH_PAD = "\u2002"; // an en space each side of a role chip's letter: room for its rounded background

// the label's chat-template markers (sgnb/widgets/_tree_rows.py GLYPHS): character -> [class, letter, name]
export const GLYPHS = {
  "\ue000": ["system", "S", "system turn"],
  "\ue001": ["user", "U", "user turn"],
  "\ue002": ["assistant", "A", "assistant turn"],
  "\ue003": ["tool", "T", "tool turn"],
  "\ue004": ["role", "R", "turn of another role"],
  "\ue005": ["end", "/", "end of turn"],
  "\ue006": ["special", "•", "special token"],
  "\ue007": ["think", "θ", "reasoning starts"],
  "\ue008": ["think_end", "/θ", "reasoning ends"],
};
const THINK_OPEN = "\ue007", THINK_END = "\ue008";

const TREE_CSS = `
.sgnb-rt {
  --sgnb-rt-bg: var(--jp-layout-color0, #fff);
  --sgnb-rt-box: var(--jp-layout-color1, #f7f7f8);
  --sgnb-rt-fg: var(--jp-ui-font-color1, #1f2328);
  --sgnb-rt-fg2: var(--jp-ui-font-color2, #57606a);
  --sgnb-rt-line: var(--jp-border-color1, #8a9099);
  --sgnb-rt-line2: var(--jp-border-color2, #d0d4d9);
  --sgnb-rt-new: var(--jp-success-color1, #1f9d3a);
  --sgnb-rt-hit: var(--jp-brand-color1, #2764d8);
  --sgnb-rt-evicted: var(--jp-error-color1, #d93025);
  --sgnb-rt-heat: #f0a020;
  --sgnb-rt-select: #9a32cd;
  font: 12px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--sgnb-rt-fg);
}
.sgnb-rt-head { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: center; margin: 2px 0 6px; }
.sgnb-rt-sum { font-weight: 600; }
.sgnb-rt-legend { display: inline-flex; flex-wrap: wrap; align-items: center; gap: 2px 10px; }
.sgnb-rt-legend > span { display: inline-flex; align-items: center; gap: 4px; }
.sgnb-rt-legend i { width: 11px; height: 11px; border-radius: 2px; display: inline-block; border: 1px solid;
  box-sizing: border-box; }
.sgnb-rt-legend i.new { background: color-mix(in srgb, var(--sgnb-rt-new) 24%, var(--sgnb-rt-box));
  border-color: var(--sgnb-rt-new); }
.sgnb-rt-legend i.hit { background: color-mix(in srgb, var(--sgnb-rt-hit) 24%, var(--sgnb-rt-box));
  border-color: var(--sgnb-rt-hit); }
.sgnb-rt-legend i.evicted { background: color-mix(in srgb, var(--sgnb-rt-evicted) 18%, var(--sgnb-rt-box));
  border: 1.5px dashed var(--sgnb-rt-evicted); }
.sgnb-rt-legend i.locked { border: 2.5px solid var(--sgnb-rt-fg); }
.sgnb-rt-legend .heat { display: inline-flex; }
.sgnb-rt-legend .heat i { border-radius: 0; border-color: var(--sgnb-rt-line); width: 9px; }
.sgnb-rt-legend .heat i + i { border-left: none; }
.sgnb-rt-ctl { display: inline-flex; gap: 10px; color: var(--sgnb-rt-fg2); }
.sgnb-rt-ctl label { display: inline-flex; align-items: center; gap: 3px; cursor: pointer; }
.sgnb-rt-ctl input { margin: 0; }
.sgnb-rt-frame { position: relative; }
.sgnb-rt-scroll { max-height: 460px; overflow: auto; border: 1px solid var(--sgnb-rt-line2);
  border-radius: 4px; background: var(--sgnb-rt-bg); scrollbar-gutter: stable; }
.sgnb-rt-pin { display: none; position: absolute; top: 5px; left: 7px; z-index: 1; box-sizing: border-box;
  height: ${BOX_H}px; padding: 2px 7px; overflow: hidden; white-space: nowrap; cursor: pointer;
  border: 1px solid var(--sgnb-rt-line); border-radius: 5px; color: var(--sgnb-rt-fg);
  background: color-mix(in srgb, var(--sgnb-rt-line) 18%, var(--sgnb-rt-box));
  box-shadow: 0 1px 4px color-mix(in srgb, var(--sgnb-rt-fg) 30%, transparent); font-size: 11px; line-height: 15px; }
.sgnb-rt[data-root-pinned="1"] .sgnb-rt-pin { display: block; }
.sgnb-rt-pin .sub { display: block; color: var(--sgnb-rt-fg2); font-size: 10px; line-height: 14px; }
.sgnb-rt svg { display: block; }
.sgnb-rt-edges { fill: none; stroke: var(--sgnb-rt-line); stroke-width: 1.2; }
.sgnb-rt-node { cursor: pointer; }
.sgnb-rt-node rect.box { fill: var(--sgnb-rt-box); stroke: var(--sgnb-rt-line); stroke-width: 1; rx: 5; ry: 5; }
.sgnb-rt-node text { fill: var(--sgnb-rt-fg); font-size: 11px; pointer-events: none; }
.sgnb-rt-node text.sub { fill: var(--sgnb-rt-fg2); font-size: 10px; }
.sgnb-rt-node.heat-1 rect.box { fill: color-mix(in srgb, var(--sgnb-rt-heat) 10%, var(--sgnb-rt-box)); }
.sgnb-rt-node.heat-2 rect.box { fill: color-mix(in srgb, var(--sgnb-rt-heat) 19%, var(--sgnb-rt-box)); }
.sgnb-rt-node.heat-3 rect.box { fill: color-mix(in srgb, var(--sgnb-rt-heat) 28%, var(--sgnb-rt-box)); }
.sgnb-rt-node.heat-4 rect.box { fill: color-mix(in srgb, var(--sgnb-rt-heat) 38%, var(--sgnb-rt-box)); }
.sgnb-rt-node.heat-5 rect.box { fill: color-mix(in srgb, var(--sgnb-rt-heat) 48%, var(--sgnb-rt-box)); }
.sgnb-rt-legend .heat i.h1 { background: color-mix(in srgb, var(--sgnb-rt-heat) 10%, var(--sgnb-rt-box)); }
.sgnb-rt-legend .heat i.h2 { background: color-mix(in srgb, var(--sgnb-rt-heat) 19%, var(--sgnb-rt-box)); }
.sgnb-rt-legend .heat i.h3 { background: color-mix(in srgb, var(--sgnb-rt-heat) 28%, var(--sgnb-rt-box)); }
.sgnb-rt-legend .heat i.h4 { background: color-mix(in srgb, var(--sgnb-rt-heat) 38%, var(--sgnb-rt-box)); }
.sgnb-rt-legend .heat i.h5 { background: color-mix(in srgb, var(--sgnb-rt-heat) 48%, var(--sgnb-rt-box)); }
.sgnb-rt[data-live="1"] .sgnb-rt-node[class*="heat-"] rect.box { fill-opacity: 0.45; }
.sgnb-rt-node.new rect.box { fill: color-mix(in srgb, var(--sgnb-rt-new) 24%, var(--sgnb-rt-box));
  stroke: var(--sgnb-rt-new); stroke-width: 1.6; }
.sgnb-rt-node.hit rect.box { fill: color-mix(in srgb, var(--sgnb-rt-hit) 24%, var(--sgnb-rt-box));
  stroke: var(--sgnb-rt-hit); stroke-width: 1.6; }
.sgnb-rt-node.evicted rect.box { fill: color-mix(in srgb, var(--sgnb-rt-evicted) 18%, var(--sgnb-rt-box));
  stroke: var(--sgnb-rt-evicted); stroke-width: 1.6; stroke-dasharray: 5 3; }
.sgnb-rt-node.evicted text.main { text-decoration: line-through; }
.sgnb-rt-node.evicted { animation: sgnb-rt-fade 20s linear forwards; }
.sgnb-rt-node.locked rect.box { stroke-width: 2.6; }
.sgnb-rt-node.root rect.box { fill: color-mix(in srgb, var(--sgnb-rt-line) 18%, var(--sgnb-rt-box)); }
.sgnb-rt-node.group rect.box { fill: var(--sgnb-rt-bg); stroke-dasharray: 4 3; }
.sgnb-rt-node.selected rect.box { stroke: var(--sgnb-rt-select); stroke-width: 3; }
.sgnb-rt.following .sgnb-rt-node.newest rect.box { stroke-dasharray: 5 2; stroke-width: 2.2; }
.sgnb-rt-node .fold { fill: var(--sgnb-rt-bg); stroke: var(--sgnb-rt-line); }
.sgnb-rt-node .lock path { fill: none; stroke: var(--sgnb-rt-fg); stroke-width: 1.4; }
.sgnb-rt-node .lock rect { fill: var(--sgnb-rt-fg); }
.sgnb-rt-chip rect { fill: var(--sgnb-rt-line2); stroke: var(--sgnb-rt-fg2); stroke-width: 1; rx: 3; ry: 3; }
.sgnb-rt-chip.video rect { fill: #1f2328; stroke: #1f2328; }
.sgnb-rt-node .sgnb-rt-chip text { font-size: 9px; fill: var(--sgnb-rt-fg2); }
.sgnb-rt-node .sgnb-rt-chip.video text { fill: #fff; }
.sgnb-rt-node text.foldmark { font-size: 11px; font-weight: 700; }
.sgnb-rt-node text tspan.role { font-size: 8.5px; font-weight: 700; fill: #fff; stroke-width: 8px;
  stroke-linejoin: round; paint-order: stroke fill; }
.sgnb-rt tspan.role.system, .sgnb-rt-details .role.system { stroke: #7c4dbd; background: #7c4dbd; }
.sgnb-rt tspan.role.user, .sgnb-rt-details .role.user { stroke: #1f6feb; background: #1f6feb; }
.sgnb-rt tspan.role.assistant, .sgnb-rt-details .role.assistant { stroke: #1a7f37; background: #1a7f37; }
.sgnb-rt tspan.role.tool, .sgnb-rt-details .role.tool { stroke: #9a6700; background: #9a6700; }
.sgnb-rt tspan.role.role, .sgnb-rt-details .role.role { stroke: #57606a; background: #57606a; }
.sgnb-rt tspan.role.think, .sgnb-rt tspan.role.think_end, .sgnb-rt-details .role.think,
.sgnb-rt-details .role.think_end { stroke: #a0529b; background: #a0529b; }
.sgnb-rt-node text tspan.think { font-style: italic; fill: #8a4a86; }
.sgnb-rt tspan.role.end, .sgnb-rt tspan.role.special,
.sgnb-rt-details .role.end, .sgnb-rt-details .role.special { stroke: #8c959f; background: #8c959f; }
@keyframes sgnb-rt-fade { from { opacity: 1; } to { opacity: 0.45; } }
.sgnb-rt-details { margin-top: 6px; padding: 6px 8px; border: 1px solid var(--sgnb-rt-line2);
  border-radius: 4px; background: var(--sgnb-rt-box); }
.sgnb-rt-details:empty { display: none; }
.sgnb-rt-details pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; max-height: 220px;
  overflow: auto; font: 12px var(--jp-code-font-family, monospace); color: var(--sgnb-rt-fg); }
.sgnb-rt-details .prefix { color: var(--sgnb-rt-fg2); }
.sgnb-rt-details .own { background: color-mix(in srgb, #f5c400 30%, var(--sgnb-rt-box)); color: var(--sgnb-rt-fg); }
.sgnb-rt-details .roles { display: flex; flex-wrap: wrap; gap: 4px; margin: 2px 0; color: var(--sgnb-rt-fg2); }
.sgnb-rt-details .role { color: #fff; border-radius: 3px; padding: 0 4px; font-size: 10px; font-weight: 700; }
.sgnb-rt-media { display: flex; flex-wrap: wrap; gap: 8px; margin: 4px 0; }
.sgnb-rt-media figure { margin: 0; font-size: 10.5px; color: var(--sgnb-rt-fg2); }
.sgnb-rt-media img { display: block; max-height: 96px; max-width: 160px; border-radius: 3px;
  border: 1px solid var(--sgnb-rt-line2); }
.sgnb-rt-empty { padding: 12px; color: var(--sgnb-rt-fg2); }
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

function visible(s) {
  const text = String(s ?? "");
  const shown = text.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  // a label of blanks alone would be an empty box: each blank that is not a newline or a tab reads ␣
  return text && !text.trim() ? shown.replace(/[^\S\n\t]/g, "␣") : shown;
}

/** A label for a node's text: whitespace made visible, cut to `n` characters. */
export function shortText(text, n = LABEL_CHARS) {
  const s = visible(text);
  return s.length > n ? s.slice(0, Math.max(n - 1, 0)) + "…" : s;
}

function charW(ch) {
  return GLYPHS[ch] ? GLYPH_CHARS : 1;
}

function width(s, from = 0, to = s.length) {
  let w = 0;
  for (let i = from; i < to; i++) w += charW(s[i]);
  return w;
}

/** The longest part of `s` from `from` on that is at most `budget` characters wide. */
function take(s, from, budget) {
  let w = 0;
  let i = from;
  while (i < s.length && w + charW(s[i]) <= budget) w += charW(s[i++]);
  return s.slice(from, i);
}

/** The part of `label` (a glyph character counts GLYPH_CHARS) drawn in `room` characters: the whole label
 * when it fits; else its start, cut with "…", when the place where it departs from its siblings (`diff`)
 * shows with some text after it; else "…" and the text from just before that place. */
export function fitLabel(label, diff, room) {
  const s = visible(label);
  const total = width(s);
  if (total <= room) return s;
  const d = Math.min(diff || 0, s.length);
  if (width(s, 0, d) + 6 <= room - 1) return take(s, 0, room - 1) + "…";
  let start = Math.max(1, d - 3); // a little of what comes before the departure, for context
  let tail = width(s, start);
  while (start > 1 && tail + charW(s[start - 1]) <= room - 1) tail += charW(s[--start]); // near the end: more before
  return tail <= room - 1 ? "…" + s.slice(start) : "…" + take(s, start, room - 2) + "…";
}

/** Put `s` into the SVG text element `t`: plain runs as text, each glyph character as a role chip (a small
 * letter in a rounded coloured blob: its stroke drawn under its fill); reasoning (after a think glyph, or from
 * the start when `inThink`, up to its end glyph) in tspans of class "think". */
function setLabel(t, s, inThink = false) {
  const key = `${inThink ? 1 : 0}${s}`;
  if (t.__label === key) return;
  t.__label = key;
  t.replaceChildren();
  let run = "";
  let thinking = inThink;
  const flush = () => {
    if (run && thinking) svgEl("tspan", { class: "think" }, t).textContent = run;
    else if (run) t.appendChild(document.createTextNode(run));
    run = "";
  };
  for (const ch of s) {
    const g = GLYPHS[ch];
    if (!g) {
      run += ch;
      continue;
    }
    run += GLYPH_PAD;
    flush();
    const span = svgEl("tspan", { class: `role ${g[0]}` }, t);
    span.textContent = g[1];
    if (ch === THINK_OPEN) thinking = true;
    else if (ch === THINK_END) thinking = false;
    run = GLYPH_PAD;
  }
  flush();
}

/** Raw text with its chat-template markers read out (for tooltips). */
function plainLabel(s) {
  let out = "";
  for (const ch of String(s ?? "")) out += GLYPHS[ch] ? `[${GLYPHS[ch][2]}]` : ch;
  return out;
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
  for (const [cls, label] of [["new", "new"], ["hit", "hit"], ["evicted", "evicted"], ["locked", "in use (locked)"]]) {
    const item = htmlEl("span", null, legend);
    htmlEl("i", cls, item);
    htmlEl("span", null, item, label);
  }
  const heat = htmlEl("span", "heat-legend", legend);
  heat.title = "a node with no live change is shaded by its cumulative hits";
  htmlEl("span", null, heat, "hits");
  const ramp = htmlEl("span", "heat", heat);
  for (let k = 1; k <= HEAT_LEVELS; k++) htmlEl("i", `h${k}`, ramp);
  const heatTop = htmlEl("span", null, heat, "");
  const ctl = htmlEl("span", "sgnb-rt-ctl", head);
  if (opts.controls === false) ctl.style.display = "none";
  const frame = htmlEl("div", "sgnb-rt-frame", root);
  const scroll = htmlEl("div", "sgnb-rt-scroll", frame);
  const svg = svgEl("svg", { width: 10, height: 10 }, scroll);
  const edges = svgEl("path", { class: "sgnb-rt-edges", d: "" }, svg);
  const layer = svgEl("g", {}, svg);
  const empty = htmlEl("div", "sgnb-rt-empty", scroll, "");
  // the root's row, pinned over the scroll box while the root is scrolled out of it (see updatePin)
  const pin = htmlEl("div", "sgnb-rt-pin", frame);
  pin.title = "the root of the tree, scrolled out of view: click to scroll back to it";
  const pinMain = htmlEl("b", null, pin, "root");
  const pinSub = htmlEl("span", "sub", pin, "");
  const details = htmlEl("div", "sgnb-rt-details", root);
  const view = {
    container, root, sum, heatTop, scroll, svg, edges, layer, empty, details, pin, pinMain, pinSub,
    els: new Map(), state: { nodes: [] }, callbacks: {}, frame: 0,
    localCollapsed: null, localSelected: undefined, rootBox: null,
    fit: !!opts.fit, follow: !!opts.follow, zoom: !!opts.zoom, followed: null, shape: "", width: 0, resize: null,
  };
  pin.addEventListener("click", (ev) => {
    ev.stopPropagation();
    const b = view.rootBox;
    if (b) {
      scroll.scrollTop = Math.max(0, b.y - 4);
      scroll.scrollLeft = Math.max(0, b.x - 6);
    }
    updatePin(view);
  });
  scroll.addEventListener("scroll", () => updatePin(view), { passive: true });
  toggle(ctl, "fit", "fit width", view.fit, (on) => {
    view.fit = on;
    schedule(view);
  });
  toggle(ctl, "zoom", "zoom to fit", view.zoom, (on) => {
    view.zoom = on;
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
      if ((view.fit || view.zoom) && scroll.clientWidth !== view.width) schedule(view);
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

/** Positions: x by depth, y by leaf order, a parent level with its first child (so the root is always at the
 * top left, in view), "+N" groups after their shown siblings. Folded subtrees are skipped. */
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
    const all = collapsed.has(row.id) ? [] : (kids.get(row.id) || []);
    const children = all.some((c) => c.group) ? [...all.filter((c) => !c.group), ...all.filter((c) => c.group)] : all;
    if (!done && children.length) {
      stack.push([row, depth, true]);
      for (let i = children.length - 1; i >= 0; i--) stack.push([children[i], depth + 1, false]);
      continue;
    }
    maxDepth = Math.max(maxDepth, depth);
    const y = children.length ? pos.get(children[0].id).y : slot++;
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
  let widest = 0;
  for (const [id, p] of out.pos) {
    const px = 6 + p.x * indent;
    const w = Math.max(OUTLINE_MIN_BOX_W, 6 + room - px);
    boxes.set(id, { px, py: 4 + p.y * OUTLINE_ROW_H, w, p });
    widest = Math.max(widest, px + w + 6);
  }
  return {
    mode: "outline", boxes, width: widest, // = avail, unless the deepest boxes hit their minimum width
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
  const t1 = svgEl("text", { class: "main", x: 7, y: 15 }, g);
  const t2 = svgEl("text", { class: "sub", x: 7, y: 29 }, g);
  const lock = svgEl("g", { class: "lock" }, g);
  svgEl("path", { d: "M2.5,5 V3.5 a3,3 0 0 1 6,0 V5" }, lock);
  svgEl("rect", { x: 0.5, y: 5, width: 10, height: 7.5, rx: 1.5 }, lock);
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
    if (e.below) onGroup(view, e.id); // folded by the overview: open its children (Python's "expanded")
    else onToggle(view, e.id);
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
  if (row.state === "evicted") {
    long.push("evicted");
    short.push("evicted");
  }
  if (folded) {
    long.push(`+${row.hidden ?? "…"} folded`);
    short.push(`+${row.hidden ?? "…"}`);
  } else if (row.below) {
    long.push(`+${row.below} below`);
    short.push(`+${row.below}↓`);
  }
  const text = long.join(" · ");
  return { text: text.length <= chars ? text : shortText(short.join(" "), chars), full: long };
}

/** A group row's two lines: "+N more like these" when its hidden children all have the shape of siblings
 * drawn beside them (e.g. hundreds of leaves), else "+N nodes". */
function groupLines(row) {
  const like = row.like_shown && row.shapes === 1;
  const kind = row.leaves === row.children ? (row.children === 1 ? "leaf" : "leaves")
    : (row.children === 1 ? "branch" : "branches");
  const first = like ? `+${row.children} more ${kind} like these` : `+${plural(row.count, "node")}`;
  const second = like && row.count !== row.children ? `${plural(row.count, "node")} · ${row.tokens} tok`
    : `${row.tokens} tok in ${plural(row.children, "branch")}`;
  return [first, second];
}

/** Scroll `scroll` so that the box at (x, y, w, h) is in view: centred vertically when it was not (or when it
 * was within `top` of the box's top, where the pinned root may cover it), and its left part in view when it was
 * not, with `left` pixels of what is before it. */
function reveal(scroll, x, y, w, h, top = 0, left = 6) {
  const H = scroll.clientHeight;
  const W = scroll.clientWidth;
  if (y < scroll.scrollTop + top || y + h > scroll.scrollTop + H) scroll.scrollTop = Math.max(0, y - (H - h) / 2);
  if (x < scroll.scrollLeft || x + Math.min(w, W) > scroll.scrollLeft + W) {
    scroll.scrollLeft = Math.max(0, x - Math.min(left, Math.max(6, W - Math.min(w, W))));
  }
}

/** Pin the root's row over the scroll box while the root's box is not wholly inside the box's visible part. */
function updatePin(view) {
  const b = view.rootBox;
  const s = view.scroll;
  const out = !!b && (b.y < s.scrollTop || b.x < s.scrollLeft || b.y + b.h > s.scrollTop + s.clientHeight
    || b.x + Math.min(b.w, s.clientWidth) > s.scrollLeft + s.clientWidth);
  const flag = out ? "1" : "0";
  if (view.root.dataset.rootPinned !== flag) view.root.dataset.rootPinned = flag;
}

function zoomFor(view, plan) {
  if (!view.zoom) return 1;
  const W = view.scroll.clientWidth;
  const maxH = parseFloat(getComputedStyle(view.scroll).maxHeight);
  const H = Number.isFinite(maxH) && maxH > 0 ? maxH - 2 : 460;
  if (!(W > 0)) return 1;
  return Math.max(MIN_ZOOM, Math.min(1, W / plan.width, H / plan.height));
}

function renderTree(view) {
  const state = view.state || {};
  const summary = state.summary || {};
  const rows = Array.isArray(state.nodes) ? state.nodes : [];
  const collapsed = collapsedSet(view);
  const selected = selectedId(view);
  view.width = view.scroll.clientWidth;
  const plan = arrange(rows, collapsed, view.fit, view.width);
  const outline = plan.mode === "outline";
  const scale = zoomFor(view, plan);
  view.svg.setAttribute("viewBox", `0 0 ${plan.width} ${plan.height}`);
  view.svg.setAttribute("width", String(Math.round(plan.width * scale)));
  view.svg.setAttribute("height", String(Math.round(plan.height * scale)));
  view.root.dataset.layout = plan.mode;
  view.root.dataset.zoom = String(Math.round(scale * 100) / 100);
  // live: a node just inserted or hit (evicted ones stay drawn for long: they do not mute the heat)
  const live = rows.some((r) => !r.group && (r.state === "new" || r.state === "hit"));
  view.root.dataset.live = live ? "1" : "0";
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
  const rootRow = rows.find((r) => !r.group && (r.parent === null || r.parent === undefined));
  const rootPlaced = rootRow ? plan.boxes.get(rootRow.id) : null;
  view.rootBox = rootPlaced ? { x: rootPlaced.px * scale, y: rootPlaced.py * scale, w: rootPlaced.w * scale,
    h: BOX_H * scale } : null;
  if (rootPlaced) {
    view.pin.style.width = `${Math.min(rootPlaced.w, BOX_W)}px`;
    view.pinSub.textContent = subLine(rootRow, collapsed.has(rootRow.id), LABEL_CHARS).text;
  }

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
    else if (row.heat > 0) cls.push(`heat-${Math.min(HEAT_LEVELS, row.heat)}`);
    if (row.locked) cls.push("locked");
    if (row.group) cls.push("group");
    if (row.parent === null || row.parent === undefined) cls.push("root");
    if (selected !== null && row.id === selected) cls.push("selected");
    if (newest !== null && row.id === newest.id) cls.push("newest");
    const media = !row.group && Array.isArray(row.media) ? row.media : [];
    if (media.length) cls.push("media");
    if (!row.group && row.think) cls.push(`think-${row.think}`);
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
      const [first, second] = groupLines(row);
      setLabel(e.t1, shortText(first, room + 4));
      e.t2.textContent = shortText(second, room + 4);
      e.title.textContent = `${first}: ${row.count} nodes hidden (${row.new} new, ${row.hit} hit, `
        + `${row.evicted} evicted); click to show them`;
      e.lock.style.display = "none";
      e.fold.style.display = "none";
    } else {
      const isRoot = row.parent === null || row.parent === undefined;
      const shown = isRoot ? "root" : fitLabel(row.label ?? row.text ?? "", row.diff || 0, room);
      // a label cut at its start ("…" then the part after the departure) may have lost its think glyph: the
      // row's own word says whether the text drawn starts inside the reasoning
      const cutInside = shown.startsWith("…") && row.think === "all";
      setLabel(e.t1, shown, !isRoot && (!!row.think_inside || cutInside));
      const sub = subLine(row, !!row.collapsed || collapsed.has(row.id), outline || media.length ? room : 99);
      e.t2.textContent = sub.text;
      const held = media.map((m) => `\n${mediaLabel(m)}`).join("");
      const heat = row.heat && summary.max_hits ? `; heat ${row.heat}/${HEAT_LEVELS} of ${summary.max_hits} hits` : "";
      const under = e.below ? `\n${row.below} nodes below it (${row.below_tokens ?? "?"} tok${row.below_state ? `, some ${row.below_state}` : ""}), folded in this overview: + shows its children` : "";
      const thought = row.think ? `; ${row.think === "all" ? "all" : "partly"} reasoning (a model's thinking)` : "";
      e.title.textContent = isRoot ? "root" : `${String(row.text ?? "")}\n(${sub.full.join(", ")}${heat}${thought})${held}${under}`;
      e.lock.style.display = row.locked ? "" : "none";
      const foldable = (row.kids || 0) > 0 || collapsed.has(row.id);
      e.below = !!row.below && !collapsed.has(row.id);
      e.fold.style.display = foldable ? "" : "none";
      e.foldMark.textContent = collapsed.has(row.id) || e.below ? "+" : "−";
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
  renderSummary(view, summary, rows);
  renderDetails(view, rows, selected, state.details || {});
  // follow: a newer node, or the same one moved by a new layout (fit toggled, the box resized)
  const shape = `${plan.mode} ${plan.width} ${scale}`;
  if (view.follow && newest !== null && (newest.id !== view.followed || shape !== view.shape)) {
    const b = plan.boxes.get(newest.id);
    // clear of the pinned root: below its row, and in columns right of the column it covers
    const left = outline ? 6 : 6 + (BOX_W + GAP_X) * scale;
    reveal(view.scroll, b.px * scale, b.py * scale, b.w * scale, BOX_H * scale, (BOX_H + 8) * scale, left);
    view.followed = newest.id;
  }
  view.shape = shape;
  updatePin(view);
}

function renderSummary(view, s, rows) {
  const nodes = s.nodes ?? rows.filter((r) => !r.group && r.state !== "evicted").length;
  const parts = [`${plural(Math.max(nodes - 1, 0), "node")} below the root`, `${s.tokens ?? 0} tokens cached`];
  if (s.locked) parts.push(`${s.locked} in use`);
  if (s.overview) {
    const folded = s.folded ? `, ${s.folded} folded` : "";
    parts.push(`overview: ${s.shown} shown (+${s.groups ?? 0} groups${folded}; + opens)`);
  } else if (s.groups) parts.push(`showing ${s.shown} (+${s.groups} groups)`);
  const evicted = Math.max(s.evicted_total ?? 0, s.evicting ?? 0);
  if (evicted) parts.push(`${evicted} evicted${s.evicting ? ` (${s.evicting} drawn)` : ""}`);
  if (s.queued) parts.push(`${s.queued} queued`);
  if (s.finished !== undefined) parts.push(plural(s.finished, "request") + " done");
  view.sum.textContent = parts.join(" · ");
  view.heatTop.textContent = s.max_hits ? `1–${s.max_hits}` : "";
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
  const label = row ? String(row.label ?? "") : "";
  const roles = [...new Set([...label].filter((ch) => GLYPHS[ch]))];
  if (roles.length) {
    const strip = htmlEl("div", "roles", box);
    for (const ch of roles) {
      htmlEl("span", `role ${GLYPHS[ch][0]}`, strip, GLYPHS[ch][1]);
      htmlEl("span", null, strip, GLYPHS[ch][2]);
    }
  }
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
  htmlEl("span", "own", pre, d ? d.text : plainLabel(row.text));
  const rids = d ? d.rids : null;
  const n = d ? d.n_rids : row.rids;
  const who = htmlEl("div", null, box);
  if (rids && rids.length) {
    who.textContent = `shared by ${plural(n, "request")}: ${rids.join(", ")}${n > rids.length ? ", …" : ""}`;
  } else {
    who.textContent = n ? `shared by ${plural(n, "request")}` : "no request recorded on this node yet";
  }
}
