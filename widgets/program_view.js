/*
 * program_view.js: ProgramView's frontend. Draws LM programs from synced traits only (a saved notebook shows
 * the same picture with no kernel). Redraws at most once per animation frame; text goes in via textContent.
 *
 * Traits:
 *   title: string
 *   summary: { programs, running, errors, gens, prompt_tokens, cached_tokens, completion_tokens, events }
 *   programs: Program[] (flat; a fork's children name their parent)
 * Program = { id, parent: id | null, name, arguments: {name: repr}, status: "running" | "done" | "error" | "interrupted",
 *             segments: Segment[], variables: string[], children: id[], error: {message, where} | null,
 *             elapsed: seconds }
 * Segment, by k:
 *   text:       { text, tmpl: bool (a chat-template role marker) }
 *   gen:        { var, rid, where, text, constraint: string | null, done: bool, chunks: int (streamed pieces),
 *                 meta: { prompt_tokens, completion_tokens, cached_tokens, finish_reason, e2e_latency,
 *                         decode_steps, forced_tokens }, tokens: [text, forced: bool][] | null (constrained
 *                 or jump-forward gens), ttft: seconds to the first text | null, elapsed: seconds | null }
 *   select:     { var, text (the choice), choices: [{ text, logprob, p (softmax probability), chosen }] }
 *   role_begin / role_end: { role }
 *   image / video: { path, name, thumb: "data:image/jpeg;base64,..." | "" (<= 72 px), frames: data URLs
 *                 (a video's sampled frames, <= 48 px, at most 16; [] when the event had none), num_frames }
 *   fork:       { children: id[] }   (the children are drawn side by side here)
 *   error:      { message, where }
 */

const PV_CSS = `
.sgnb-pv { font: 13px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #222); }
.sgnb-pv-head { margin: 2px 0 6px; }
.sgnb-pv-head b { margin-right: 8px; }
.sgnb-pv-sum { color: var(--jp-ui-font-color2, #666); font-size: 12px; }
.sgnb-pv-prog { border: 1px solid var(--jp-border-color2, #d0d7de); border-radius: 6px; margin: 4px 0;
  background: var(--jp-layout-color0, #fff); min-width: 0; }
.sgnb-pv-prog.running { border-color: #2764d8; }
.sgnb-pv-prog.error { border-color: #d93025; }
.sgnb-pv-ph { display: flex; gap: 8px; align-items: baseline; padding: 3px 8px; font-size: 12px;
  background: var(--jp-layout-color2, #f3f4f6); border-radius: 6px 6px 0 0; }
.sgnb-pv-status { font-weight: 600; }
.sgnb-pv-status.running { color: #2764d8; } .sgnb-pv-status.done { color: #1f9d3a; } .sgnb-pv-status.error { color: #d93025; }
.sgnb-pv-status.interrupted { color: #b06000; }
.sgnb-pv-args { color: var(--jp-ui-font-color2, #666); overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.sgnb-pv-body { padding: 6px 8px; white-space: pre-wrap; word-break: break-word;
  font: 12.5px/1.55 var(--jp-code-font-family, ui-monospace, monospace); }
.sgnb-pv-role { border-left: 3px solid var(--jp-border-color1, #aaa); margin: 3px 0; padding: 1px 0 1px 7px; }
.sgnb-pv-role-name { font: 600 10px var(--jp-ui-font-family, sans-serif); text-transform: uppercase;
  color: var(--jp-ui-font-color2, #666); display: block; }
.sgnb-pv-tmpl { color: var(--jp-ui-font-color3, #999); }
.sgnb-pv-gen { border-radius: 3px; padding: 0 1px; border-bottom: 2px solid; }
.sgnb-pv-var { font: 600 9.5px var(--jp-ui-font-family, sans-serif); border-radius: 3px; padding: 0 3px;
  margin-right: 2px; vertical-align: super; color: #fff; }
.sgnb-pv-live::after { content: "▍"; animation: sgnb-pv-blink 1s steps(2) infinite; }
@keyframes sgnb-pv-blink { 50% { opacity: 0; } }
.sgnb-pv-tok.forced { background: repeating-linear-gradient(135deg, rgba(0,0,0,.10) 0 3px, transparent 3px 6px);
  text-decoration: underline dotted; }
.sgnb-pv-tok.sampled { }
.sgnb-pv-constraint { font: 10px var(--jp-ui-font-family, sans-serif); border: 1px solid #8a9099;
  border-radius: 3px; padding: 0 3px; margin-right: 3px; color: var(--jp-ui-font-color2, #555); }
.sgnb-pv-choices { display: inline-flex; gap: 4px; vertical-align: middle; margin-left: 4px; font: 10.5px var(--jp-ui-font-family, sans-serif); }
.sgnb-pv-choice { border: 1px solid #c9ced6; border-radius: 3px; padding: 0 4px; position: relative; overflow: hidden;
  white-space: pre; }
.sgnb-pv-choice.chosen { border-color: #1f2328; font-weight: 700; }
.sgnb-pv-bar { position: absolute; left: 0; bottom: 0; height: 3px; background: #7b61ff; }
.sgnb-pv-fork { display: flex; gap: 6px; align-items: flex-start; margin: 4px 0; white-space: normal; }
.sgnb-pv-fork > .sgnb-pv-prog { flex: 1 1 0; }
.sgnb-pv-img { height: 48px; vertical-align: middle; border-radius: 3px; border: 1px solid #ccc; margin: 0 2px; }
.sgnb-pv-strip { display: inline-flex; align-items: center; gap: 1px; vertical-align: middle; margin: 0 2px;
  padding: 3px 4px; border-radius: 3px; background: #1f2328; }
.sgnb-pv-frame { height: 36px; display: block; }
.sgnb-pv-strip-n { font: 10px var(--jp-ui-font-family, sans-serif); color: #e6e6e6; margin-left: 4px; white-space: nowrap; }
.sgnb-pv-media { font: 11px var(--jp-ui-font-family, sans-serif); border: 1px solid #ccc; border-radius: 3px; padding: 1px 4px; }
.sgnb-pv-error { display: block; color: #a4161a; background: #fde7e9; border-radius: 4px; padding: 3px 6px; margin: 3px 0; }
.sgnb-pv-gens { border-collapse: collapse; margin: 2px 8px 6px; font-size: 11px; }
.sgnb-pv-gens td, .sgnb-pv-gens th { padding: 1px 7px; text-align: right; border-bottom: 1px solid var(--jp-border-color2, #eee); }
.sgnb-pv-gens td:first-child, .sgnb-pv-gens th:first-child { text-align: left; }
.sgnb-pv-gens th { font-weight: 600; color: var(--jp-ui-font-color2, #666); }
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

function genTitle(seg) {
  const m = seg.meta || {};
  const lines = [`${seg.var ?? "(unnamed gen)"}  ${seg.rid ?? ""}`];
  if (seg.constraint) lines.push(`constraint: ${seg.constraint}`);
  if (m.prompt_tokens !== undefined) lines.push(`prompt ${m.prompt_tokens} tok (${m.cached_tokens ?? 0} cached)`);
  if (m.completion_tokens !== undefined) lines.push(`completion ${m.completion_tokens} tok, ${m.decode_steps ?? "?"} decode steps, ${m.forced_tokens ?? 0} forced`);
  if (m.e2e_latency !== undefined) lines.push(`latency ${fmt(m.e2e_latency, 3)} s`);
  if (m.finish_reason) lines.push(`finish: ${JSON.stringify(m.finish_reason)}`);
  if (seg.where) lines.push(String(seg.where));
  return lines.join("\n");
}

function drawGen(seg, parent) {
  const h = hue(seg.var);
  if (seg.var !== null && seg.var !== undefined) {
    const tag = el("span", "sgnb-pv-var", parent, seg.var);
    tag.style.background = `hsl(${h} 55% 42%)`;
  }
  if (seg.constraint) {
    // a plain-text label: the chain glyph it had needs an emoji font that many machines lack
    const c = el("span", "sgnb-pv-constraint", parent, `constrained: ${seg.constraint.length > 28 ? seg.constraint.slice(0, 27) + "…" : seg.constraint}`);
    c.title = seg.constraint;
  }
  const span = el("span", "sgnb-pv-gen", parent);
  span.dataset.var = seg.var ?? "";
  span.style.background = `hsl(${h} 80% 90%)`;
  span.style.borderColor = `hsl(${h} 55% 45%)`;
  span.style.color = "#1f2328";
  span.title = genTitle(seg);
  if (Array.isArray(seg.tokens) && seg.tokens.length) {
    for (const [text, forced] of seg.tokens) el("span", `sgnb-pv-tok ${forced ? "forced" : "sampled"}`, span, text);
    const shown = seg.tokens.map((t) => t[0]).join("");
    if (seg.text.length > shown.length && seg.text.startsWith(shown)) el("span", null, span, seg.text.slice(shown.length));
  } else {
    span.textContent = seg.text;
  }
  if (!seg.done) span.classList.add("sgnb-pv-live");
}

function drawSelect(seg, parent) {
  const h = hue(seg.var);
  if (seg.var !== null && seg.var !== undefined) {
    const tag = el("span", "sgnb-pv-var", parent, seg.var);
    tag.style.background = `hsl(${h} 55% 42%)`;
  }
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

function drawGensTable(prog, parent) {
  const gens = prog.segments.filter((s) => s.k === "gen");
  if (!gens.length) return;
  const table = el("table", "sgnb-pv-gens", parent);
  const head = el("tr", null, table);
  for (const h of ["gen", "prompt", "cached", "completion", "decode steps", "forced", "TTFT s", "latency s", "tok/s", "finish"]) el("th", null, head, h);
  for (const g of gens) {
    const m = g.meta || {};
    const tr = el("tr", null, table);
    const lat = m.e2e_latency ?? g.elapsed;
    const tps = lat && m.completion_tokens ? m.completion_tokens / lat : null;
    const finish = m.finish_reason ? (m.finish_reason.type ?? JSON.stringify(m.finish_reason)) : (g.done ? "" : "running");
    const cells = [g.var ?? "(gen)", m.prompt_tokens ?? "", m.cached_tokens ?? "", m.completion_tokens ?? "",
      m.decode_steps ?? "", m.forced_tokens ?? "", fmt(g.ttft, 3), fmt(lat, 3), fmt(tps, 1), finish];
    cells.forEach((c, i) => {
      const td = el("td", null, tr, c);
      if (i === 0) td.style.color = `hsl(${hue(g.var)} 55% 35%)`;
    });
  }
}

function drawProgram(prog, byId, parent, depth) {
  const box = el("div", `sgnb-pv-prog ${prog.status}`, parent);
  box.dataset.program = prog.id;
  const head = el("div", "sgnb-pv-ph", box);
  el("span", null, head, prog.name || (prog.parent ? `branch ${prog.id}` : prog.id));
  el("span", `sgnb-pv-status ${prog.status}`, head, prog.status);
  el("span", "sgnb-pv-sum", head, `${fmt(prog.elapsed, 2)} s`);
  const args = Object.entries(prog.arguments || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  if (args) el("span", "sgnb-pv-args", head, args).title = args;
  const body = el("div", "sgnb-pv-body", box);
  const stack = [body];
  for (const seg of prog.segments) {
    const cur = stack[stack.length - 1];
    switch (seg.k) {
      case "text":
        el("span", seg.tmpl ? "sgnb-pv-tmpl" : "sgnb-pv-text", cur, seg.text);
        break;
      case "gen":
        drawGen(seg, cur);
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
      case "fork": {
        const row = el("div", "sgnb-pv-fork", cur);
        for (const cid of seg.children || []) {
          const child = byId.get(cid);
          if (child && depth < 32) drawProgram(child, byId, row, depth + 1);
        }
        break;
      }
      case "error":
        el("span", "sgnb-pv-error", cur, `error: ${seg.message}${seg.where ? "\n  at " + seg.where : ""}`);
        break;
      default:
        break;
    }
  }
  drawGensTable(prog, box);
}

function draw(model, root) {
  const programs = model.get("programs") || [];
  const s = model.get("summary") || {};
  const byId = new Map(programs.map((p) => [p.id, p]));
  const frag = document.createDocumentFragment();
  const head = el("div", "sgnb-pv-head", frag);
  if (model.get("title")) el("b", null, head, model.get("title"));
  const parts = [`${s.programs ?? programs.length} program${(s.programs ?? programs.length) === 1 ? "" : "s"}`];
  if (s.running) parts.push(`${s.running} running`);
  if (s.errors) parts.push(`${s.errors} failed`);
  if (s.gens) parts.push(`${s.gens} gen${s.gens === 1 ? "" : "s"}: ${s.prompt_tokens ?? 0} prompt tok (${s.cached_tokens ?? 0} cached), ${s.completion_tokens ?? 0} generated`);
  el("span", "sgnb-pv-sum", head, parts.join(" · "));
  for (const p of programs) {
    if (!p.parent || !byId.has(p.parent)) drawProgram(p, byId, frag, 0);
  }
  if (!programs.length) el("div", "sgnb-pv-sum", frag, "(waiting for a program)");
  root.replaceChildren(frag);
}

function render({ model, el: host }) {
  const wrap = el("div", "sgnb-pv", host);
  el("style", null, wrap, PV_CSS);
  const root = el("div", null, wrap);
  let frame = 0;
  const update = () => {
    if (frame) return;
    const run = () => {
      frame = 0;
      draw(model, root);
    };
    frame = typeof requestAnimationFrame === "function" ? requestAnimationFrame(run) : setTimeout(run, 16);
  };
  draw(model, root);
  for (const k of ["programs", "summary", "title"]) model.on(`change:${k}`, update);
  return () => {
    for (const k of ["programs", "summary", "title"]) model.off(`change:${k}`, update);
    wrap.remove();
  };
}

export default { render };
