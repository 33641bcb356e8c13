/**
 * sgnb's JupyterLab extension: the "LM engine" side panel, `%%sgl` cell highlighting, and sgnb's views in
 * notebooks reopened without widget state (their saved snapshots).
 */
import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { EditorExtensionRegistry, IEditorExtensionRegistry } from '@jupyterlab/codemirror';
import { INotebookTracker } from '@jupyterlab/notebook';
import { LabIcon } from '@jupyterlab/ui-components';

import { EnginePanel } from './panel';
import { sglCellExtension } from './sgl';
import { SavedViewsExtension } from './views';

export const COMMAND_SHOW_PANEL = 'sgnb:show-engine-panel';

const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">
<g class="jp-icon3" fill="#616161"><circle cx="8" cy="2.5" r="2"/><circle cx="3" cy="13" r="2"/>
<circle cx="8" cy="13" r="2"/><circle cx="13" cy="13" r="2"/>
<path d="M7.5 4h1v3.5H13V11h-1V8.5H8.5V11h-1V8.5H4V11H3V7.5h4.5z"/></g></svg>`;

export const engineIcon = new LabIcon({ name: 'sgnb:engine', svgstr: ICON_SVG });

const panelPlugin: JupyterFrontEndPlugin<void> = {
  id: 'sgnb:engine-panel',
  description: 'A side panel with the live radix tree and engine stats of the active notebook kernel.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette, ILayoutRestorer, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    labShell: ILabShell | null
  ) => {
    const panel = new EnginePanel(tracker);
    panel.title.icon = engineIcon;
    app.shell.add(panel, 'right', { rank: 900 });
    restorer?.add(panel, panel.id);

    app.commands.addCommand(COMMAND_SHOW_PANEL, {
      label: 'sgnb: Show LM engine panel',
      caption: 'Show the radix tree and engine stats of the active notebook kernel',
      icon: engineIcon,
      execute: () => {
        if (labShell) {
          labShell.expandRight();
        }
        app.shell.activateById(panel.id);
      }
    });
    palette?.addItem({ command: COMMAND_SHOW_PANEL, category: 'sgnb' });
  }
};

const sglPlugin: JupyterFrontEndPlugin<void> = {
  id: 'sgnb:sgl-cells',
  description: 'Marks %%sgl cell magics and gives editors stable tok-* token classes.',
  autoStart: true,
  requires: [IEditorExtensionRegistry],
  activate: (app: JupyterFrontEnd, registry: IEditorExtensionRegistry) => {
    registry.addExtension({
      name: 'sgnb:sgl-cells',
      // notebook cells are "inline" editors: every editor gets it (it only marks text that starts with %%sgl)
      factory: () => EditorExtensionRegistry.createImmutableExtension(sglCellExtension())
    });
  }
};

const savedViewsPlugin: JupyterFrontEndPlugin<void> = {
  id: 'sgnb:saved-views',
  description: "Shows an sgnb view's saved snapshot where its widget model is gone (a notebook reopened without " +
    'widget state), and keeps live views in place when the kernel updates their snapshot.',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    app.docRegistry.addWidgetExtension('Notebook', new SavedViewsExtension());
  }
};

export default [panelPlugin, sglPlugin, savedViewsPlugin];
