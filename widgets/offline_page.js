/*
 * offline_page.js: draws the saved widgets of an exported notebook page with no kernel and no network. sgnb's HTML
 * export (sgnb.export.export_html) inlines this classic script in place of the @jupyter-widgets/html-manager,
 * require.js and anywidget that nbconvert's page loads from public CDNs.
 *
 * The page holds the widget state (<script type="application/vnd.jupyter.widget-state+json">, all models) and one
 * <script type="application/vnd.jupyter.widget-view+json"> ({model_id}) per widget output, next to the output's
 * static snapshot (.sgnb-static-output, from the output's text/html). For each view:
 *   - an anywidget (every sgnb view): its ES module is in the state (`_esm`); it is imported from a blob: URL and
 *     its render({model, el}) runs on a local model (get, set, on, off, save_changes, send: no kernel, so a
 *     change stays in the page, which is what a click on a tree node needs);
 *   - ipywidgets' HTML, Label, progress bars and boxes (tqdm's bar): drawn plainly;
 *   - anything else is left to the static snapshot.
 * A view that rendered replaces its static snapshot; one that failed leaves it (and says why in the console).
 * When every view is done, <html> gets data-sgnb-widgets="N rendered, M static".
 */
(() => {
  "use strict";
  const STATE_TYPE = "application/vnd.jupyter.widget-state+json";
  const VIEW_TYPE = "application/vnd.jupyter.widget-view+json";

  function readState() {
    const tag = document.querySelector(`script[type="${STATE_TYPE}"]`);
    if (!tag) return {};
    try {
      return JSON.parse(tag.textContent).state || {};
    } catch (e) {
      console.warn("sgnb: unreadable widget state", e);
      return {};
    }
  }

  /** A model's state with its binary buffers (saved base64 at a path into the state) as DataViews. */
  function withBuffers(entry) {
    const state = { ...(entry.state || {}) };
    for (const buf of entry.buffers || []) {
      if (buf.encoding !== "base64" || !Array.isArray(buf.path) || !buf.path.length) continue;
      const raw = atob(buf.data || "");
      const bytes = new Uint8Array(raw.length);
      for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
      let at = state;
      for (const key of buf.path.slice(0, -1)) at = at[key] = Array.isArray(at[key]) ? [...at[key]] : { ...at[key] };
      at[buf.path[buf.path.length - 1]] = new DataView(bytes.buffer);
    }
    return state;
  }

  class LocalModel {
    constructor(id, state) {
      this.model_id = id;
      this.state = state;
      this.listeners = new Map();
    }

    get(key) {
      return this.state[key];
    }

    set(key, value) {
      const changes = typeof key === "object" && key !== null ? key : { [key]: value };
      const changed = Object.keys(changes).filter((k) => this.state[k] !== changes[k]);
      Object.assign(this.state, changes);
      for (const k of changed) this.emit(`change:${k}`, this.state[k]);
      if (changed.length) this.emit("change");
    }

    on(name, callback) {
      for (const n of String(name).split(/\s+/)) {
        if (!this.listeners.has(n)) this.listeners.set(n, new Set());
        this.listeners.get(n).add(callback);
      }
    }

    off(name, callback) {
      if (!name) this.listeners.clear();
      for (const n of String(name || "").split(/\s+/)) {
        if (!callback) this.listeners.delete(n);
        else this.listeners.get(n)?.delete(callback);
      }
    }

    emit(name, value) {
      for (const callback of [...(this.listeners.get(name) || [])]) {
        try {
          callback(this, value);
        } catch (e) {
          console.error("sgnb: a widget's listener failed", e);
        }
      }
    }

    save_changes() {} // no kernel: changes stay here

    send() {} // no kernel to answer
  }

  const modules = new Map(); // ES module text -> Promise of its widget definition
  const styles = new Set();
  const initialized = new Set();

  async function importText(text) {
    const url = URL.createObjectURL(new Blob([text], { type: "text/javascript" }));
    try {
      return await import(url);
    } catch (e) {
      // some pages cannot import blob: URLs (an opaque origin): a data: URL imports everywhere
      return import(`data:text/javascript;charset=utf-8,${encodeURIComponent(text)}`);
    } finally {
      URL.revokeObjectURL(url);
    }
  }

  /** anywidget's front-end module: `export default {initialize, render}`, a (maybe async) function returning
   *  that, or named `render` / `initialize` exports. */
  function definition(esm) {
    if (!modules.has(esm)) {
      modules.set(esm, importText(esm).then(async (mod) => {
        let def = mod.default;
        if (typeof def === "function") def = await def();
        return def && typeof def.render === "function" ? def : mod;
      }));
    }
    return modules.get(esm);
  }

  async function renderAnywidget(model, el) {
    const css = model.get("_css");
    if (typeof css === "string" && css && !styles.has(css)) {
      styles.add(css);
      const style = document.createElement("style");
      style.textContent = css;
      document.head.appendChild(style);
    }
    const def = await definition(model.get("_esm"));
    if (typeof def.render !== "function") throw new Error("its module has no render()");
    if (!initialized.has(model.model_id)) {
      initialized.add(model.model_id);
      if (typeof def.initialize === "function") await def.initialize({ model });
    }
    await def.render({ model, el });
  }

  function child(models, ref) {
    return models.get(String(ref).replace(/^IPY_MODEL_/, ""));
  }

  /** ipywidgets' simple views (what tqdm's notebook bar is made of); false for anything else. */
  function drawPlain(model, models, el, depth) {
    const name = model.get("_model_name");
    const add = (tag) => el.appendChild(document.createElement(tag));
    if ((name === "HBoxModel" || name === "VBoxModel" || name === "BoxModel") && depth < 16) {
      const box = add("div");
      box.style.cssText = `display: flex; gap: 4px; align-items: center; flex-direction: ${name === "VBoxModel" ? "column" : "row"}`;
      let drawn = false;
      for (const ref of model.get("children") || []) {
        const c = child(models, ref);
        if (c) drawn = drawPlain(c, models, box, depth + 1) || drawn;
      }
      return drawn;
    }
    if (name === "HTMLModel" || name === "HTMLMathModel") {
      add("span").innerHTML = model.get("value") ?? ""; // the kernel's HTML, as a text/html output would be
      return true;
    }
    if (name === "LabelModel") {
      add("span").textContent = model.get("value") ?? "";
      return true;
    }
    if (name === "FloatProgressModel" || name === "IntProgressModel") {
      const bar = add("progress");
      const lo = Number(model.get("min") ?? 0);
      bar.max = Math.max(Number(model.get("max") ?? 100) - lo, 0);
      bar.value = Math.max(Number(model.get("value") ?? 0) - lo, 0);
      return true;
    }
    return false;
  }

  async function renderView(tag, models) {
    let id;
    try {
      id = JSON.parse(tag.textContent).model_id;
    } catch (e) {
      return false;
    }
    const model = models.get(id);
    if (!model) return false;
    const el = document.createElement("div");
    el.className = "sgnb-offline-view";
    tag.parentNode.insertBefore(el, tag); // in the page before render: a view may measure its width
    try {
      if (typeof model.get("_esm") === "string") await renderAnywidget(model, el);
      else if (!drawPlain(model, models, el, 0)) throw new Error(`no offline view for ${model.get("_model_name")}`);
    } catch (e) {
      el.remove();
      console.warn(`sgnb: widget ${id} keeps its static snapshot:`, e);
      return false;
    }
    for (const s of tag.parentNode.querySelectorAll(":scope > .sgnb-static-output")) s.remove();
    return true;
  }

  async function renderAll() {
    const saved = readState();
    const models = new Map(Object.entries(saved).map(([id, entry]) => [id, new LocalModel(id, withBuffers(entry))]));
    const tags = [...document.querySelectorAll(`script[type="${VIEW_TYPE}"]`)];
    const done = await Promise.all(tags.map((tag) => renderView(tag, models)));
    const n = done.filter(Boolean).length;
    document.documentElement.dataset.sgnbWidgets = `${n} rendered, ${done.length - n} static`;
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", renderAll);
  else renderAll();
})();
