// EngineStats' frontend: the model's traits -> drawStats (stats_draw.js, inlined by Python's bundler).
import { drawStats } from "./stats_draw.js";

function render({ model, el }) {
  const state = () => ({ stats: model.get("stats"), history: model.get("history") });
  const handle = drawStats(el, state());
  const update = () => drawStats(el, state());
  model.on("change:stats", update);
  model.on("change:history", update);
  return () => {
    model.off("change:stats", update);
    model.off("change:history", update);
    handle.destroy();
  };
}

export default { render };
