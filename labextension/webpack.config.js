// Merged into @jupyter/builder's rspack config (package.json "jupyterlab.webpackConfig").
// `@sgnb/widgets/*` resolves to the Python package's widgets/ folder, so the panel bundles the very drawing
// modules that the notebook widgets load (widgets/radix_tree_draw.js, widgets/stats_draw.js): one copy of
// the drawing code, no fork.
const path = require('path');

module.exports = {
  resolve: {
    alias: {
      '@sgnb/widgets': path.resolve(__dirname, '..', 'widgets')
    }
  }
};
