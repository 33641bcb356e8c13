/*
 * program_view.js: ProgramView's frontend. Draws LM programs from synced traits only (a saved notebook shows
 * the same picture with no kernel). Redraws at most once per animation frame; text goes in via textContent.
 *
 * Traits:
 *   title: string
 *   summary: { programs, running, errors, gens, selects, prompt_tokens, cached_tokens, completion_tokens, events }
 *   programs: Program[] (flat; a fork's children name their parent)
 * Program = { id, parent: id | null, name, arguments: {name: repr}, status: "running" | "done" | "error" | "interrupted",
 *             segments: Segment[], variables: string[], children: id[], error: {message, where} | null,
 *             elapsed: seconds }
 * Segment, by k:
 *   text:       { text, tmpl: bool (a chat-template role marker), cached?: int (how many of its characters the
 *                 engine's cache served to the gen that read it first; absent until a gen read it) }
 *   gen:        { var, rid, where, text, constraint: string | null, constraint_name: a JSON schema's title | null,
 *                 done: bool, chunks: int (streamed pieces),
 *                 meta: { prompt_tokens, completion_tokens, cached_tokens, finish_reason, e2e_latency, ttft,
 *                         decode_steps, forced_tokens }, tokens: [text, forced: bool, logprob | null,
 *                 [[alternative, logprob], ...] | null][] | null (the texts concatenate to `text`),
 *                 logprobs: bool, ttft: seconds (the engine's, same clock as e2e_latency) | null,
 *                 elapsed: wall seconds from gen() to its result | null, cached_chars?, cached_exact?,
 *                 think?: (a gen inside separate_reasoning) { format: reasoning parser name, state: "start" |
 *                   "reasoning" | "answer" (where the stream is), text: the reasoning so far (between the markers),
 *                   tokens: its tokens (markers included), seconds: thinking time | null, end: where the answer
 *                   starts in `text` | null (still thinking), done } }
 *   select:     { var, text (the choice), choices: [{ text, logprob, p (softmax probability), chosen }],
 *                 meta?: { prompt_tokens, cached_tokens } (over its choices' scoring), elapsed?: wall seconds }
 *   error:      { message, where, below: bool (a traceback under the view has the message: the view marks the spot) }
 *   role_begin / role_end: { role }
 *   image / video: { path, name, thumb: "data:image/jpeg;base64,..." | "" (<= 72 px), frames: data URLs
 *                 (a video's sampled frames, <= 48 px, at most 16; [] when the event had none), num_frames }
 *   fork:       { children: id[] }   (up to MAX_COLS columns in all side by side, else one tab per branch)
 *   error:      { message, where }
 *   prior:      { text, chars, from }   (a continued state's earlier text, shown collapsed: the view did not see
 *                 that run; its last 4000 characters)
 *
 * Layout: a fork's branches sit side by side while the whole group needs at most MAX_COLS columns (a branch
 * that forks again needs as many as its own groups), each at least MIN_COL px wide (the row scrolls sideways
 * when the output is narrower); a wider group shows one branch at a time under tabs (or, on request, side by
 * side with a scroll bar). Each top-level program has one metrics table, for its gens and its branches'.
 */

const MAX_COLS = 3;
const MIN_COL = 220; // px: the narrowest a branch column gets

const PV_CSS = `
.sgnb-pv { font: 13px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #222);
  position: relative; max-width: 100%; min-width: 0; }
.sgnb-pv-head { margin: 2px 0 4px; display: flex; flex-wrap: wrap; gap: 2px 8px; align-items: baseline; }
.sgnb-pv-sum { color: var(--jp-ui-font-color2, #666); font-size: 12px; }
.sgnb-pv-legend { display: flex; flex-wrap: wrap; gap: 2px 10px; align-items: center; margin: 0 0 6px;
  font: 11px var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color2, #555); }
.sgnb-pv-legend label { cursor: pointer; display: inline-flex; align-items: center; gap: 3px; }
.sgnb-pv-key { display: inline-flex; align-items: center; gap: 3px; }
.sgnb-pv-sw { display: inline-block; width: 18px; height: 11px; border-radius: 2px; vertical-align: middle; }
.sgnb-pv-sw.sampled { background: hsl(210 80% 88%); border-bottom: 2px solid hsl(210 55% 45%); }
.sgnb-pv-sw.forced { background: #8a919c; }
.sgnb-pv-sw.cached { background: rgba(110, 120, 140, .22); box-shadow: inset 0 -1px 0 rgba(80, 90, 110, .5); }
.sgnb-pv-sw.prob { width: 54px; background: linear-gradient(90deg, hsl(0 70% 45%), hsl(60 70% 45%), hsl(120 70% 38%)); }
.sgnb-pv-prog { border: 1px solid var(--jp-border-color2, #d0d7de); border-radius: 6px; margin: 4px 0;
  background: var(--jp-layout-color0, #fff); min-width: 0; }
.sgnb-pv-prog.running { border-color: #2764d8; }
.sgnb-pv-prog.error { border-color: #d93025; }
.sgnb-pv-ph { display: flex; flex-wrap: wrap; gap: 0 8px; align-items: baseline; padding: 3px 8px; font-size: 12px;
  background: var(--jp-layout-color2, #f3f4f6); border-radius: 6px 6px 0 0; min-width: 0; }
.sgnb-pv-ph > span { white-space: nowrap; }
.sgnb-pv-status { font-weight: 600; }
.sgnb-pv-status.running { color: #2764d8; } .sgnb-pv-status.done { color: #1f9d3a; } .sgnb-pv-status.error { color: #d93025; }
.sgnb-pv-status.interrupted { color: #b06000; }
.sgnb-pv-ph > .sgnb-pv-args { color: var(--jp-ui-font-color2, #666); overflow: hidden; text-overflow: ellipsis;
  min-width: 0; flex: 1 1 0; }
.sgnb-pv-body { padding: 6px 8px; white-space: pre-wrap; overflow-wrap: anywhere;
  font: 12.5px/1.55 var(--jp-code-font-family, ui-monospace, monospace); }
.sgnb-pv-role { border-left: 3px solid var(--jp-border-color1, #aaa); margin: 3px 0; padding: 1px 0 1px 7px; }
.sgnb-pv-role-name { font: 600 10px var(--jp-ui-font-family, sans-serif); text-transform: uppercase;
  color: var(--jp-ui-font-color2, #666); display: block; }
.sgnb-pv-tmpl { color: var(--jp-ui-font-color3, #999); }
.sgnb-pv-cached { background: rgba(110, 120, 140, .16); box-shadow: inset 0 -1px 0 rgba(80, 90, 110, .35); }
.sgnb-pv-prior { display: block; margin: 0 0 3px; color: var(--jp-ui-font-color3, #999); }
.sgnb-pv-prior > summary { font: 11px var(--jp-ui-font-family, sans-serif); cursor: pointer; }
.sgnb-pv-gen { border-radius: 3px; padding: 0 1px; border-bottom: 2px solid; }
.sgnb-pv-var { font: 600 9.5px var(--jp-ui-font-family, sans-serif); border-radius: 3px; padding: 0 3px;
  margin-right: 2px; vertical-align: super; color: #fff; }
.sgnb-pv-think { display: block; margin: 2px 0; border-left: 3px solid; border-radius: 3px; padding: 1px 6px;
  background: var(--jp-layout-color2, #f6f7f9); white-space: normal; }
.sgnb-pv-think > summary { font: 11px var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color2, #555);
  cursor: pointer; }
.sgnb-pv-think-text { display: block; white-space: pre-wrap; color: var(--jp-ui-font-color2, #57606a);
  font-style: italic; }
.sgnb-pv-live::after { content: "▍"; animation: sgnb-pv-blink 1s steps(2) infinite; }
@keyframes sgnb-pv-blink { 50% { opacity: 0; } }
.sgnb-pv-tok { border-radius: 2px; }
.sgnb-pv-tok.forced { background: #8a919c; color: #fff; }
.sgnb-pv-root.show-tokens .sgnb-pv-tok { box-shadow: inset -1px 0 0 rgba(0, 0, 0, .38), inset 0 -3px 0 var(--pc, transparent); }
.sgnb-pv-root.show-tokens .sgnb-pv-tok.sampled:nth-child(even) { background: rgba(0, 0, 0, .07); }
.sgnb-pv-tok:hover { outline: 1px solid #1f2328; }
.sgnb-pv-constraint { font: 10px var(--jp-ui-font-family, sans-serif); border: 1px solid #8a9099;
  border-radius: 3px; padding: 0 3px; margin-right: 3px; color: var(--jp-ui-font-color2, #555); }
.sgnb-pv-choices { display: inline-flex; flex-wrap: wrap; gap: 3px 4px; max-width: 100%; vertical-align: middle;
  margin-left: 4px; font: 10.5px/1.5 var(--jp-ui-font-family, sans-serif); }
.sgnb-pv-choice { border: 1px solid #c9ced6; border-radius: 3px; padding: 0 4px 1px; position: relative;
  overflow: hidden; white-space: pre-wrap; overflow-wrap: anywhere; max-width: 100%; box-sizing: border-box; }
.sgnb-pv-choice.chosen { border-color: var(--jp-ui-font-color1, #1f2328); font-weight: 700; }
.sgnb-pv-bar { position: absolute; left: 0; bottom: 0; height: 3px; background: #7b61ff; }
.sgnb-pv-fork { display: flex; gap: 6px; align-items: flex-start; margin: 4px 0; white-space: normal;
  overflow-x: auto; max-width: 100%; }
.sgnb-pv-fork > .sgnb-pv-prog { flex: 1 0 0; min-width: ${MIN_COL}px; }
.sgnb-pv-group { margin: 4px 0; white-space: normal; }
.sgnb-pv-tabs { display: flex; flex-wrap: wrap; gap: 2px; align-items: flex-end;
  border-bottom: 1px solid var(--jp-border-color2, #d0d7de); font: 11.5px var(--jp-ui-font-family, sans-serif); }
.sgnb-pv-tab { border: 1px solid var(--jp-border-color2, #d0d7de); border-bottom: none; border-radius: 5px 5px 0 0;
  padding: 2px 7px; background: var(--jp-layout-color2, #f3f4f6); color: inherit; cursor: pointer; font: inherit;
  max-width: 260px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.sgnb-pv-tab.selected { background: var(--jp-layout-color0, #fff); font-weight: 600; margin-bottom: -1px;
  padding-bottom: 3px; }
.sgnb-pv-tab .dot { display: inline-block; width: 7px; height: 7px; border-radius: 50%; margin-right: 4px; background: #1f9d3a; }
.sgnb-pv-tab .dot.running { background: #2764d8; } .sgnb-pv-tab .dot.error { background: #d93025; }
.sgnb-pv-tab .dot.interrupted { background: #b06000; }
.sgnb-pv-layout { margin-left: auto; border: none; background: none; color: #2764d8; cursor: pointer; font: inherit;
  padding: 2px 4px; }
.sgnb-pv-img { height: 48px; vertical-align: middle; border-radius: 3px; border: 1px solid #ccc; margin: 0 2px; }
.sgnb-pv-strip { display: inline-flex; align-items: center; gap: 1px; vertical-align: middle; margin: 0 2px;
  padding: 3px 4px; border-radius: 3px; background: #1f2328; }
.sgnb-pv-frame { height: 36px; display: block; }
.sgnb-pv-strip-n { font: 10px var(--jp-ui-font-family, sans-serif); color: #e6e6e6; margin-left: 4px; white-space: nowrap; }
.sgnb-pv-media { font: 11px var(--jp-ui-font-family, sans-serif); border: 1px solid #ccc; border-radius: 3px; padding: 1px 4px; }
.sgnb-pv-error { display: block; color: #a4161a; background: #fde7e9; border-radius: 4px; padding: 3px 6px; margin: 3px 0; }
.sgnb-pv-metrics { margin: 2px 8px 6px; font-size: 11px; max-width: calc(100% - 16px); overflow-x: auto; }
.sgnb-pv-metrics > summary { cursor: pointer; color: var(--jp-ui-font-color2, #666); }
.sgnb-pv-gens { border-collapse: collapse; font-size: 11px; white-space: nowrap; }
.sgnb-pv-gens td, .sgnb-pv-gens th { padding: 1px 7px; text-align: right; border-bottom: 1px solid var(--jp-border-color2, #eee); }
.sgnb-pv-gens td:first-child, .sgnb-pv-gens th:first-child, .sgnb-pv-gens td.branch, .sgnb-pv-gens th.branch { text-align: left; }
.sgnb-pv-gens th { font-weight: 600; color: var(--jp-ui-font-color2, #666); }
.sgnb-pv-card { position: fixed; z-index: 1000; display: none; min-width: 170px; max-width: 320px; padding: 6px 8px;
  border: 1px solid var(--jp-border-color1, #8a9099); border-radius: 5px; background: var(--jp-layout-color0, #fff);
  box-shadow: 0 2px 8px rgba(0, 0, 0, .18); font: 11.5px/1.45 var(--jp-ui-font-family, sans-serif); pointer-events: none; }
.sgnb-pv-card.open { display: block; }
.sgnb-pv-card code { font: 12px var(--jp-code-font-family, ui-monospace, monospace); white-space: pre-wrap; overflow-wrap: anywhere; }
.sgnb-pv-card .kind { color: var(--jp-ui-font-color2, #555); }
.sgnb-pv-card table { border-collapse: collapse; margin: 3px 0; width: 100%; }
.sgnb-pv-card td { padding: 0 4px 0 0; white-space: pre; }
.sgnb-pv-card td.p { text-align: right; }
.sgnb-pv-card tr.chosen td { font-weight: 700; }
.sgnb-pv-card .bar { display: inline-block; height: 6px; background: #7b61ff; border-radius: 1px; }
.sgnb-pv-card .foot { color: var(--jp-ui-font-color2, #666); border-top: 1px solid var(--jp-border-color2, #eee);
  margin-top: 3px; padding-top: 2px; }
`;

function el(tag, cls, parent, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (parent) parent.appendChild(e);
  return e;
}

/** A stable colour per variable name. */
function hue(name) {
  let h = 0;
  for (const ch of String(name ?? "")) h = (h * 31 + ch.codePointAt(0)) % 360;
  return h;
}

function fmt(x, digits = 2) {
  return typeof x === "number" ? x.toFixed(digits) : "–";
}

function pct(p) {
  if (typeof p !== "number") return "?";
  return p >= 0.1 ? `${(p * 100).toFixed(0)}%` : p >= 0.001 ? `${(p * 100).toFixed(1)}%` : "<0.1%";
}

/** Colour of a probability: red (unlikely) through yellow to green (certain). */
function probColour(p) {
  return `hsl(${Math.round(120 * Math.max(0, Math.min(1, p)))} 70% ${p > 0.5 ? 38 : 45}%)`;
}

/** One line per timing and count of a gen (its tooltip, the token card's footer). */
function genLines(seg) {
  const m = seg.meta || {};
  const lines = [];
  if (seg.constraint) lines.push(`constraint: ${seg.constraint}`);
  if (m.prompt_tokens !== undefined) {
    const where = m.cached_tokens ? " (the shaded prompt text)" : "";
    lines.push(`prompt ${m.prompt_tokens} tok, ${m.cached_tokens ?? 0} from the cache${where}`);
  }
  if (m.completion_tokens !== undefined) lines.push(`output ${m.completion_tokens} tok: ${m.decode_steps ?? "?"} decode steps, ${m.forced_tokens ?? 0} forced by the grammar`);
  if (m.e2e_latency !== undefined) lines.push(`engine: TTFT ${fmt(seg.ttft, 3)} s, latency ${fmt(m.e2e_latency, 3)} s (from the request's arrival)`);
  if (typeof seg.elapsed === "number") lines.push(`in the program: ${fmt(seg.elapsed, 3)} s (tokenizing, queueing, grammar compile included)`);
  if (seg.think && seg.think.end) lines.push(`reasoning: ${thinkLabel(seg.think)} (${seg.think.format})`);
  if (m.finish_reason) lines.push(`finish: ${JSON.stringify(m.finish_reason)}`);
  if (seg.where) lines.push(String(seg.where));
  return lines;
}

function varTag(seg, parent) {
  if (seg.var === null || seg.var === undefined) return;
  const tag = el("span", "sgnb-pv-var", parent, seg.var);
  tag.style.background = `hsl(${hue(seg.var)} 55% 42%)`;
}

/** "thought for 412 tokens, 3.1 s" (or "thinking… 37 tokens" while it streams). */
function thinkLabel(think) {
  const n = `${think.tokens ?? 0} token${think.tokens === 1 ? "" : "s"}`;
  if (think.end === null || think.end === undefined) return `thinking… ${n}`;
  return `thought for ${n}${typeof think.seconds === "number" ? `, ${think.seconds.toFixed(1)} s` : ""}`;
}

/** A gen's reasoning as a folded block (a click unfolds it; kept open across redraws). */
function drawThink(seg, parent, where, ctx) {
  const think = seg.think;
  const det = el("details", "sgnb-pv-think", parent);
  det.dataset.var = seg.var ?? "";
  det.style.borderColor = `hsl(${hue(seg.var)} 55% 45%)`;
  const key = `${where.prog}:${where.seg}`;
  det.open = ctx.ui.thinks.get(key) ?? false;
  det.addEventListener("toggle", () => ctx.ui.thinks.set(key, det.open));
  const summary = el("summary", null, det, thinkLabel(think));
  summary.title = `${seg.var ?? "the gen"}'s reasoning (${think.format}), split off by separate_reasoning`;
  const body = el("span", "sgnb-pv-think-text", det, think.text);
  if (think.end === null || think.end === undefined) body.classList.add("sgnb-pv-live");
}

function drawGen(seg, parent, where, ctx) {
  const h = hue(seg.var);
  const think = seg.think;
  // the answer starts after the reasoning (none yet while thinking); before the stream knows, the raw text
  const from = !think || think.state === "start" ? 0 : (think.end ?? seg.text.length);
  if (think && (from > 0 || think.state === "reasoning" || think.text)) drawThink(seg, parent, where, ctx);
  varTag(seg, parent);
  if (seg.constraint) {
    // a plain-text label: the chain glyph it had needs an emoji font that many machines lack
    const shown = seg.constraint_name ?? (seg.constraint.length > 28 ? seg.constraint.slice(0, 27) + "…" : seg.constraint);
    const c = el("span", "sgnb-pv-constraint", parent, `constrained: ${shown}`);
    c.title = seg.constraint;
  }
  const span = el("span", "sgnb-pv-gen", parent);
  span.dataset.var = seg.var ?? "";
  span.style.background = `hsl(${h} 80% 90%)`;
  span.style.borderColor = `hsl(${h} 55% 45%)`;
  span.style.color = "#1f2328";
  if (Array.isArray(seg.tokens) && seg.tokens.length) {
    // each token its own span: the card on hover tells its probability and alternatives (no title: one tooltip)
    let pos = 0;
    seg.tokens.forEach(([text, forced, lp], i) => {
      const at = pos;
      pos += text.length;
      if (pos <= from) return;  // the reasoning's: in its block
      const t = el("span", `sgnb-pv-tok ${forced ? "forced" : "sampled"}`, span, at < from ? text.slice(from - at) : text);
      t.dataset.prog = where.prog;
      t.dataset.seg = where.seg;
      t.dataset.tok = i;
      if (typeof lp === "number") t.style.setProperty("--pc", probColour(Math.exp(lp)));
    });
    const shown = seg.tokens.map((t) => t[0]).join("");
    if (seg.text.length > shown.length && seg.text.startsWith(shown)) el("span", null, span, seg.text.slice(Math.max(from, shown.length)));
  } else {
    span.textContent = seg.text.slice(from);
    span.title = [`${seg.var ?? "(unnamed gen)"}  ${seg.rid ?? ""}`, ...genLines(seg)].join("\n");
  }
  const thinking = think && (think.end === null || think.end === undefined) && think.state === "reasoning";
  if (!seg.done && !thinking) span.classList.add("sgnb-pv-live");  // while it thinks, the cursor is in its block
}

function drawSelect(seg, parent) {
  const h = hue(seg.var);
  varTag(seg, parent);
  const span = el("span", "sgnb-pv-gen sgnb-pv-selected", parent, seg.text);
  span.style.background = `hsl(${h} 80% 90%)`;
  span.style.borderColor = `hsl(${h} 55% 45%)`;
  span.style.color = "#1f2328";
  const box = el("span", "sgnb-pv-choices", parent);
  for (const c of seg.choices || []) {
    const p = typeof c.p === "number" ? c.p : null;
    const item = el("span", `sgnb-pv-choice${c.chosen ? " chosen" : ""}`, box, `${JSON.stringify(c.text)} ${p === null ? "?" : Math.round(p * 100) + "%"}`);
    item.title = `logprob (normalized) ${fmt(c.logprob, 4)}`;
    const bar = el("span", "sgnb-pv-bar", item);
    bar.style.width = `${Math.round((p || 0) * 100)}%`;
  }
}

/** Prompt text, the part the engine's cache served shaded (`cached` characters from its start). */
function drawText(seg, parent) {
  const cls = seg.tmpl ? "sgnb-pv-tmpl" : "sgnb-pv-text";
  const n = typeof seg.cached === "number" ? Math.min(seg.cached, seg.text.length) : 0;
  if (n > 0) el("span", `${cls} sgnb-pv-cached`, parent, seg.text.slice(0, n));
  if (n < seg.text.length) el("span", cls, parent, seg.text.slice(n));
}

/** A data: URL of an image, or "" (thumbnails come from Python; anything else is not shown). */
function imageUrl(x) {
  return typeof x === "string" && x.startsWith("data:image/") ? x : "";
}

function drawMedia(seg, parent) {
  const frames = (Array.isArray(seg.frames) ? seg.frames : []).map(imageUrl).filter(Boolean);
  const what = `${seg.k}${seg.name ? " " + seg.name : ""}${seg.num_frames ? ` (${seg.num_frames} frames)` : ""}`;
  if (seg.k === "video" && frames.length) {
    const strip = el("span", "sgnb-pv-strip", parent);
    strip.title = what;
    for (const url of frames) {
      const img = el("img", "sgnb-pv-frame", strip);
      img.src = url;
      img.alt = "";
    }
    const n = seg.num_frames ?? frames.length;
    el("span", "sgnb-pv-strip-n", strip, `${n} frame${n === 1 ? "" : "s"}`);
  } else if (imageUrl(seg.thumb)) {
    const img = el("img", "sgnb-pv-img", parent);
    img.src = imageUrl(seg.thumb);
    img.alt = seg.name || seg.k;
    img.title = what;
  } else {
    const icon = seg.k === "video" ? "[video]" : "[image]";  // text, not emoji: renders without emoji fonts
    const n = seg.num_frames ? ` (${seg.num_frames} frames)` : "";
    el("span", "sgnb-pv-media", parent, `${icon} ${seg.name || seg.path || seg.k}${n}`).title = seg.path;
  }
}

// ---- the branch structure -----------------------------------------------------------------------------
/** Branch labels by program id: a top-level program's fork children are "1", "2", ...; theirs "1.1", ... */
function branchLabels(programs, byId) {
  const labels = new Map();
  const visit = (p, label, depth) => {
    labels.set(p.id, label);
    if (depth > 32) return;
    (p.children || []).forEach((cid, i) => {
      const c = byId.get(cid);
      if (c && !labels.has(cid)) visit(c, label ? `${label}.${i + 1}` : String(i + 1), depth + 1);
    });
  };
  for (const p of programs) if (!p.parent || !byId.has(p.parent)) visit(p, "", 0);
  return labels;
}

function forkKids(prog, seg, ctx) {
  return (seg.children || []).map((id) => ctx.byId.get(id)).filter(Boolean);
}

/** How a fork group is drawn: "cols" (side by side) or "tabs"; the user's choice wins over the default. */
function groupMode(prog, i, kids, ctx, depth) {
  const chosen = ctx.ui.layouts.get(`${prog.id}:${i}`);
  if (chosen) return chosen;
  const cols = kids.reduce((n, k) => n + columns(k, ctx, depth + 1), 0);
  return kids.length > 1 && cols > MAX_COLS ? "tabs" : "cols";
}

/** The columns a program needs: 1, or what its widest fork group needs as drawn. */
function columns(prog, ctx, depth = 0) {
  if (ctx.cols.has(prog.id)) return ctx.cols.get(prog.id);
  let w = 1;
  if (depth < 32) {
    prog.segments.forEach((seg, i) => {
      if (seg.k !== "fork") return;
      const kids = forkKids(prog, seg, ctx);
      const widths = kids.map((k) => columns(k, ctx, depth + 1));
      const mode = groupMode(prog, i, kids, ctx, depth);
      w = Math.max(w, mode === "tabs" ? Math.max(1, ...widths) : widths.reduce((a, b) => a + b, 0));
    });
  }
  ctx.cols.set(prog.id, w);
  return w;
}

/** A few words that tell a branch from its siblings: the first thing it generated. */
function branchSnippet(prog) {
  for (const s of prog.segments) {
    if ((s.k === "gen" || s.k === "select") && s.text && s.text.trim()) {
      const t = s.text.trim().replace(/\s+/g, " ");
      return `${s.var ? s.var + ": " : ""}${t.length > 26 ? t.slice(0, 25) + "…" : t}`;
    }
  }
  return "";
}

function drawFork(prog, i, seg, ctx, parent, depth) {
  const kids = forkKids(prog, seg, ctx);
  const key = `${prog.id}:${i}`;
  const natural = kids.length > 1 && kids.reduce((n, k) => n + columns(k, ctx, depth + 1), 0) > MAX_COLS;
  const mode = groupMode(prog, i, kids, ctx, depth);
  const group = el("div", `sgnb-pv-group ${mode}`, parent);
  group.dataset.group = key;
  if (mode === "tabs") {
    const strip = el("div", "sgnb-pv-tabs", group);
    const sel = Math.min(ctx.ui.tabs.get(key) ?? 0, kids.length - 1);
    kids.forEach((k, j) => {
      const tab = el("button", `sgnb-pv-tab${j === sel ? " selected" : ""}`, strip);
      tab.type = "button";
      el("span", `dot ${k.status}`, tab);
      const snip = branchSnippet(k);
      tab.append(`branch ${ctx.labels.get(k.id) || k.id}${snip ? " · " + snip : ""}`);
      tab.title = `${k.id}: ${k.status}${snip ? "\n" + snip : ""}`;
      tab.addEventListener("click", () => { ctx.ui.tabs.set(key, j); ctx.redraw(); });
    });
    const side = el("button", "sgnb-pv-layout", strip, "side by side");
    side.type = "button";
    side.title = "all branches side by side (scroll sideways)";
    side.addEventListener("click", () => { ctx.ui.layouts.set(key, "cols"); ctx.redraw(); });
    if (kids[sel]) drawProgram(kids[sel], ctx, group, depth + 1);
    return;
  }
  if (natural) {  // the user asked for columns where tabs are the default: offer them back
    const strip = el("div", "sgnb-pv-tabs", group);
    const back = el("button", "sgnb-pv-layout", strip, "tabs");
    back.type = "button";
    back.addEventListener("click", () => { ctx.ui.layouts.set(key, "tabs"); ctx.redraw(); });
  }
  const row = el("div", "sgnb-pv-fork", group);
  for (const k of kids) drawProgram(k, ctx, row, depth + 1);
}

// ---- metrics: one table per top-level program, its branches' gens included ------------------------------
function gensOf(prog, ctx, out, depth = 0) {
  for (const seg of prog.segments) {
    if (seg.k === "gen" || (seg.k === "select" && seg.meta)) out.push([prog, seg]);
    else if (seg.k === "fork" && depth < 32) for (const k of forkKids(prog, seg, ctx)) gensOf(k, ctx, out, depth + 1);
  }
  return out;
}

const METRIC_HEADS = [
  ["variable", "the variable of the gen or select (a select scores its choices: no output, no TTFT)"],
  ["branch", "which fork branch ran it (1.2: the second branch of the first)"],
  ["prompt", "prompt tokens"],
  ["cached", "prompt tokens the engine's radix cache served (not computed again)"],
  ["output", "generated tokens"],
  ["forced", "output tokens the grammar wrote (jump-forward), not sampled"],
  ["TTFT s", "engine: from the request's arrival to its first output token"],
  ["latency s", "engine: from the request's arrival to its end (same clock as TTFT); the wall time in the program, with tokenizing, queueing and grammar compile, is in the tooltip"],
  ["tok/s", "output tokens per second of latency"],
  ["finish", "why it stopped"],
];

function drawMetrics(prog, ctx, parent) {
  const gens = gensOf(prog, ctx, []);
  if (!gens.length) return;
  const branched = gens.some(([p]) => p.id !== prog.id);
  const det = el("details", "sgnb-pv-metrics", parent);
  det.open = ctx.ui.tables.get(prog.id) ?? true;
  det.addEventListener("toggle", () => ctx.ui.tables.set(prog.id, det.open));
  const branches = new Set(gens.map(([p]) => p.id)).size;
  const nSel = gens.filter(([, g]) => g.k === "select").length, nGen = gens.length - nSel;
  const counted = [nGen ? `${nGen} gen${nGen === 1 ? "" : "s"}` : "", nSel ? `${nSel} select${nSel === 1 ? "" : "s"}` : ""].filter(Boolean).join(", ");
  el("summary", null, det, `metrics: ${counted}${branched ? ` in ${branches} branch${branches === 1 ? "" : "es"}` : ""}`);
  const table = el("table", "sgnb-pv-gens", det);
  const head = el("tr", null, table);
  for (const [h, why] of METRIC_HEADS) {
    if (h === "branch" && !branched) continue;
    const th = el("th", h === "branch" ? "branch" : null, head, h);
    th.title = why;
  }
  for (const [p, g] of gens) {
    const m = g.meta || {};
    const tr = el("tr", null, table);
    tr.dataset.program = p.id;
    const lat = m.e2e_latency ?? g.elapsed;
    const tps = lat && m.completion_tokens ? m.completion_tokens / lat : null;
    const select = g.k === "select";  // scored, not generated: its prompt and cache hits, its wall time
    const finish = select ? "select" : m.finish_reason ? (m.finish_reason.type ?? JSON.stringify(m.finish_reason)) : (g.done ? "" : "running");
    const cells = [["gen", g.var ?? (select ? "(select)" : "(gen)")], ["branch", ctx.labels.get(p.id) || "main"], ["prompt", m.prompt_tokens ?? ""],
      ["cached", m.cached_tokens ?? ""], ["output", m.completion_tokens ?? ""], ["forced", m.forced_tokens ?? ""],
      ["ttft", fmt(g.ttft, 3)], ["latency", fmt(lat, 3)], ["tps", fmt(tps, 1)], ["finish", finish]];
    for (const [k, c] of cells) {
      if (k === "branch" && !branched) continue;
      const td = el("td", k === "branch" ? "branch" : k, tr, c);
      if (k === "gen") td.style.color = `hsl(${hue(g.var)} 55% 35%)`;
      if (k === "latency" && typeof g.elapsed === "number") {
        td.title = `engine ${fmt(m.e2e_latency, 3)} s · in the program ${fmt(g.elapsed, 3)} s (with tokenizing, queueing, grammar compile)`;
      }
    }
  }
}

// ---- programs -------------------------------------------------------------------------------------------
function drawProgram(prog, ctx, parent, depth) {
  const box = el("div", `sgnb-pv-prog ${prog.status}`, parent);
  box.dataset.program = prog.id;
  const head = el("div", "sgnb-pv-ph", box);
  const label = ctx.labels.get(prog.id);
  el("span", null, head, prog.parent && label ? `branch ${label}` : prog.name || prog.id).title = prog.id;
  el("span", `sgnb-pv-status ${prog.status}`, head, prog.status);
  const clock = el("span", "sgnb-pv-sum", head, `${fmt(prog.elapsed, 2)} s`);
  if (prog.status === "running") {  // counts on between updates (tick in render)
    clock.classList.add("sgnb-pv-clock");
    clock.dataset.elapsed = String(prog.elapsed ?? 0);
  }
  const args = Object.entries(prog.arguments || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  if (args && !prog.parent) el("span", "sgnb-pv-args", head, args).title = args;
  const body = el("div", "sgnb-pv-body", box);
  const stack = [body];
  prog.segments.forEach((seg, i) => {
    const cur = stack[stack.length - 1];
    switch (seg.k) {
      case "text":
        drawText(seg, cur);
        break;
      case "gen":
        drawGen(seg, cur, { prog: prog.id, seg: i }, ctx);
        break;
      case "select":
        drawSelect(seg, cur);
        break;
      case "role_begin": {
        const role = el("div", `sgnb-pv-role role-${seg.role}`, cur);
        el("span", "sgnb-pv-role-name", role, seg.role);
        stack.push(role);
        break;
      }
      case "role_end":
        if (stack.length > 1) stack.pop();
        break;
      case "image":
      case "video":
        drawMedia(seg, cur);
        break;
      case "fork":
        if (depth < 32) drawFork(prog, i, seg, ctx, cur, depth);
        break;
      case "prior": {
        const det = el("details", "sgnb-pv-prior", cur);
        el("summary", null, det, `continues ${seg.from}: ${seg.chars} characters before`);
        el("span", "sgnb-pv-tmpl", det, seg.text);
        break;
      }
      case "error":
        if (seg.below) {  // the cell's traceback, under the view, has the message
          const kind = /^([A-Za-z_][\w.]*)(?=:)/.exec(seg.message || "");
          el("span", "sgnb-pv-error", cur, `failed here${kind ? ` (${kind[1]})` : ""}: the traceback is below`).title = seg.message;
        } else {
          el("span", "sgnb-pv-error", cur, `error: ${seg.message}${seg.where ? "\n  at " + seg.where : ""}`);
        }
        break;
      default:
        break;
    }
  });
  if (depth === 0) drawMetrics(prog, ctx, box);
}

/** The legend of what the marks mean (only those that occur) and the token-boundary switch. */
function drawLegend(programs, ctx, parent) {
  const gens = programs.flatMap((p) => p.segments.filter((s) => s.k === "gen"));
  const tokens = gens.some((g) => Array.isArray(g.tokens) && g.tokens.length);
  const forced = gens.some((g) => (g.tokens || []).some((t) => t[1]));
  const probs = gens.some((g) => g.logprobs);
  const cached = programs.some((p) => p.segments.some((s) => s.k === "text" && s.cached > 0));
  if (!tokens && !cached) return;
  const bar = el("div", "sgnb-pv-legend", parent);
  if (tokens) {
    const lab = el("label", null, bar);
    const box = el("input", null, lab);
    box.type = "checkbox";
    box.name = "tokens";
    box.checked = ctx.showTokens;
    box.addEventListener("change", () => { ctx.ui.tokens = box.checked; ctx.redraw(); });
    lab.append("token boundaries");
    const key = (cls, text, why) => {
      const k = el("span", "sgnb-pv-key", bar);
      el("span", `sgnb-pv-sw ${cls}`, k);
      k.append(text);
      k.title = why;
    };
    if (forced) {
      key("sampled", "sampled", "tokens the model sampled (coloured by their variable)");
      key("forced", "forced (grammar / jump-forward)", "tokens the constraint's grammar wrote without sampling");
    }
    if (probs) key("prob", "probability: low → high", "the underline of a sampled token (with token boundaries on)");
    el("span", null, bar, probs ? "hover a token: probability and top alternatives" : "hover a token for its details");
  }
  if (cached) {
    const k = el("span", "sgnb-pv-key", bar);
    el("span", "sgnb-pv-sw cached", k);
    k.append("prompt served from the cache");
    k.title = "the part of each gen's prompt whose KV the engine's radix cache already held (placed from token counts: to a few characters)";
  }
}

function draw(model, root, ui, redraw) {
  const programs = model.get("programs") || [];
  const s = model.get("summary") || {};
  const byId = new Map(programs.map((p) => [p.id, p]));
  const ctx = { byId, labels: branchLabels(programs, byId), ui, redraw, cols: new Map() };
  const anyLogprobs = programs.some((p) => p.segments.some((g) => g.k === "gen" && g.logprobs));
  ctx.showTokens = ui.tokens ?? anyLogprobs;  // on by default when logprobs were asked for
  ui.last = ctx;
  root.classList.toggle("show-tokens", ctx.showTokens);
  const frag = document.createDocumentFragment();
  const head = el("div", "sgnb-pv-head", frag);
  if (model.get("title")) el("b", null, head, model.get("title"));
  const tops = programs.filter((p) => !p.parent || !byId.has(p.parent)).length;
  const branches = programs.length - tops;
  const parts = [`${tops} program${tops === 1 ? "" : "s"}${branches ? `, ${branches} branch${branches === 1 ? "" : "es"}` : ""}`];
  if (s.running) parts.push(`${s.running} running`);
  if (s.errors) parts.push(`${s.errors} failed`);
  if (s.gens || s.selects) {
    const what = [s.gens ? `${s.gens} gen${s.gens === 1 ? "" : "s"}` : "", s.selects ? `${s.selects} select${s.selects === 1 ? "" : "s"}` : ""].filter(Boolean).join(", ");
    parts.push(`${what}: ${s.prompt_tokens ?? 0} prompt tok (${s.cached_tokens ?? 0} cached), ${s.completion_tokens ?? 0} generated`);
  }
  el("span", "sgnb-pv-sum", head, parts.join(" · "));
  drawLegend(programs, ctx, frag);
  for (const p of programs) {
    if (!p.parent || !byId.has(p.parent)) drawProgram(p, ctx, frag, 0);
  }
  if (!programs.length) el("div", "sgnb-pv-sum", frag, "(waiting for a program)");
  root.replaceChildren(frag);
}

// ---- the token card (hover) -------------------------------------------------------------------------------
function fillCard(card, prog, seg, i) {
  const [text, forced, lp, alts] = seg.tokens[i];
  card.replaceChildren();
  el("code", null, card, JSON.stringify(text));
  el("span", "kind", card, `  token ${i + 1} of ${seg.tokens.length} of ${seg.var ?? "the gen"}`);
  el("div", null, card, forced ? "forced: the grammar wrote it (jump-forward), nothing was sampled"
    : typeof lp === "number" ? `sampled · p ${pct(Math.exp(lp))} (logprob ${lp.toFixed(3)})` : "sampled");
  if (Array.isArray(alts) && alts.length) {
    el("div", "kind", card, `top ${alts.length} alternatives`);
    const table = el("table", null, card);
    for (const [alt, alp] of alts) {
      const p = typeof alp === "number" ? Math.exp(alp) : null;
      const tr = el("tr", alt === text ? "chosen" : null, table);
      el("td", null, tr, JSON.stringify(alt));
      el("td", "p", tr, pct(p));
      const bar = el("span", "bar", el("td", null, tr));
      bar.style.width = `${Math.round((p ?? 0) * 60)}px`;
    }
  } else if (!forced && typeof lp !== "number") {
    el("div", "kind", card, "no probabilities: ask with %%sgl --logprobs (or gen(..., return_logprob=True, top_logprobs_num=5))");
  }
  const foot = genLines(seg).filter((l) => /^(prompt|output|engine)/.test(l));
  if (foot.length) el("div", "foot", card, foot.join("\n")).style.whiteSpace = "pre-wrap";
}

function render({ model, el: host }) {
  const wrap = el("div", "sgnb-pv", host);
  el("style", null, wrap, PV_CSS);
  const root = el("div", "sgnb-pv-root", wrap);
  const card = el("div", "sgnb-pv-card", wrap);
  // what the user chose, kept across redraws: token boundaries (null: the default), tab and layout per fork
  // group, open metrics tables and reasoning blocks
  const ui = { tokens: null, tabs: new Map(), layouts: new Map(), tables: new Map(), thinks: new Map(), last: null };
  let frame = 0;
  const redraw = () => draw(model, root, ui, update);
  const update = () => {
    if (frame) return;
    const run = () => {
      frame = 0;
      redraw();
    };
    frame = typeof requestAnimationFrame === "function" ? requestAnimationFrame(run) : setTimeout(run, 16);
  };
  const show = (ev) => {
    const t = ev.target instanceof Element ? ev.target.closest(".sgnb-pv-tok") : null;
    if (!t || !ui.last) return;
    const prog = ui.last.byId.get(t.dataset.prog);
    const seg = prog && prog.segments[Number(t.dataset.seg)];
    if (!seg || !Array.isArray(seg.tokens) || !seg.tokens[Number(t.dataset.tok)]) return;
    fillCard(card, prog, seg, Number(t.dataset.tok));
    card.classList.add("open");
    // fixed, so that no output area clips it: under the token (above it near the window's bottom), within the
    // view's width; then corrected by where it landed (a transformed ancestor moves fixed boxes)
    const box = wrap.getBoundingClientRect();
    const r = t.getBoundingClientRect();
    const w = card.offsetWidth, h = card.offsetHeight;
    const x = Math.max(box.left, Math.min(r.left, box.right - w));
    const y = r.bottom + 4 + h > window.innerHeight && r.top - 4 - h >= 0 ? r.top - 4 - h : r.bottom + 4;
    card.style.left = `${x}px`;
    card.style.top = `${y}px`;
    const got = card.getBoundingClientRect();
    card.style.left = `${2 * x - got.left}px`;
    card.style.top = `${2 * y - got.top}px`;
  };
  const hide = (ev) => {
    const t = ev.target instanceof Element ? ev.target.closest(".sgnb-pv-tok") : null;
    if (t) card.classList.remove("open");
  };
  root.addEventListener("mouseover", show);
  root.addEventListener("mouseout", hide);
  // running programs' clocks move between model updates (a long prefill sends none): from the elapsed time of
  // the last update, plus the time since it was drawn
  let drawnAt = performance.now();
  const stamp = () => { drawnAt = performance.now(); };
  model.on("change:programs", stamp);
  const tick = setInterval(() => {
    const dt = (performance.now() - drawnAt) / 1000;
    for (const c of root.querySelectorAll(".sgnb-pv-clock")) c.textContent = `${fmt(Number(c.dataset.elapsed) + dt, 2)} s`;
  }, 250);
  redraw();
  for (const k of ["programs", "summary", "title"]) model.on(`change:${k}`, update);
  return () => {
    clearInterval(tick);
    model.off("change:programs", stamp);
    for (const k of ["programs", "summary", "title"]) model.off(`change:${k}`, update);
    wrap.remove();
  };
}

export default { render };
