// RadixTreeView's frontend: the model's traits -> drawTree (radix_tree_draw.js, inlined by Python's bundler).
import { drawTree } from "./radix_tree_draw.js";

const KEYS = ["nodes", "summary", "collapsed", "selected", "details"];

function save(model, key, value) {
  model.set(key, value);
  try {
    model.save_changes(); // no kernel (a saved notebook): the change stays local, which is all we need
  } catch (e) {
    /* ignore */
  }
}

function render({ model, el }) {
  const callbacks = {
    select(id) {
      save(model, "selected", id);
    },
    toggle(id) {
      const folded = new Set(model.get("collapsed") || []);
      if (folded.has(id)) folded.delete(id);
      else folded.add(id);
      save(model, "collapsed", [...folded]);
    },
    expandGroup(parentId) {
      const open = new Set(model.get("expanded") || []);
      open.add(parentId);
      save(model, "expanded", [...open]);
    },
  };
  const state = () => Object.fromEntries(KEYS.map((k) => [k, model.get(k)]));
  // a notebook's output is as wide as the notebook: start in "fit width", so a deep tree becomes an outline
  // instead of a drawing that scrolls sideways
  const handle = drawTree(el, state(), callbacks, { fit: true });
  const update = () => drawTree(el, state(), callbacks);
  for (const k of KEYS) model.on(`change:${k}`, update);
  return () => {
    for (const k of KEYS) model.off(`change:${k}`, update);
    handle.destroy();
  };
}

export default { render };
