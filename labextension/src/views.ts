/**
 * sgnb's views in a notebook reopened without their widget models: the saved snapshot instead of "Error
 * displaying widget: model not found".
 *
 * An sgnb view's output carries, beside the widget view, a static HTML snapshot of the view (text/html with the
 * class `sgnb-static`; the kernel sends the output again whenever the snapshot moves on: widgets/_display.py).
 * JupyterLab and Notebook 7 save no widget state by default, so after the kernel is shut down a reopened
 * notebook has outputs whose models no kernel knows, and the widget manager's renderer shows an error there.
 *
 * For each notebook this wraps its rendermime registry's `createRenderer` (the instance's, so that it holds
 * whichever renderer the widget manager registers and whenever it does): a renderer for the widget view of an
 * sgnb output (`SavedViewRenderer`) shows the snapshot at once and asks the widget manager's renderer for the
 * live view beside it, hidden; once that renderer holds a widget the live view replaces the snapshot. When the
 * model is gone (no kernel knows it), the snapshot simply stays. Other outputs go to the widget manager's
 * renderer untouched.
 *
 * The kernel sends an open view's output again so that the saved snapshot stays current (an update of the same
 * display id). The widget manager's renderer would build a new view for each such update (scroll position,
 * folds and toggles lost); here an update that names the model already drawn live keeps the live view.
 */
import type { DocumentRegistry } from '@jupyterlab/docregistry';
import type { INotebookModel, NotebookPanel } from '@jupyterlab/notebook';
import type { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';
import { Panel, Widget } from '@lumino/widgets';

export const WIDGET_VIEW_MIME = 'application/vnd.jupyter.widget-view+json';
/** The class of the root element of every sgnb snapshot (widgets/_static.py). */
export const SNAPSHOT_CLASS = 'sgnb-static';

/** The rendermime registry methods used here (IRenderMimeRegistry, without importing its package). */
interface IRegistry {
  createRenderer(mimeType: string): IRenderMime.IRenderer;
}

/** Whether an output's data is an sgnb view with its snapshot. */
export function isSgnbView(data: IRenderMime.IMimeModel['data']): boolean {
  const html = data['text/html'];
  return !!data[WIDGET_VIEW_MIME] && typeof html === 'string' && html.includes(SNAPSHOT_CLASS);
}

function modelId(data: IRenderMime.IMimeModel['data']): string {
  const view = data[WIDGET_VIEW_MIME] as { model_id?: unknown } | undefined;
  return typeof view?.model_id === 'string' ? view.model_id : '';
}

/**
 * The widget view of an output, or its snapshot while the view is not (or no longer) there. Holds the widget
 * manager's renderer (`inner`) and, while no live view shows, a text/html renderer of the snapshot.
 */
export class SavedViewRenderer extends Panel implements IRenderMime.IRenderer {
  constructor(
    private readonly _inner: IRenderMime.IRenderer,
    private readonly _registry: IRegistry
  ) {
    super();
    this.addClass('sgnb-SavedView');
    this.addWidget(_inner);
    // the live view arrives when the widget manager has the model: maybe much later (a kernel that restores
    // it), so watch the inner renderer rather than the promise of one call
    this._observer = new MutationObserver(() => this._settle());
    this._observer.observe(_inner.node, { childList: true });
  }

  /** Whether the live view is drawn (not the snapshot). */
  get live(): boolean {
    const inner = this._inner as Widget & { widgets?: ReadonlyArray<Widget> };
    return !inner.isDisposed && !!inner.widgets && inner.widgets.some(w => !w.isDisposed) &&
      !inner.isHidden;
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    this._ours = isSgnbView(model.data);
    if (!this._ours) {
      this._dropSnapshot();
      this._inner.node.style.display = '';
      return this._inner.renderModel(model);
    }
    const id = modelId(model.data);
    if (id && id === this._liveId && this.live) {
      // the same model, drawn live: its traits keep it current; the new snapshot is for the saved file
      this._model = model;
      return;
    }
    this._model = model;
    this._liveId = id;
    await this._showSnapshot(model);
    try {
      await this._inner.renderModel(model);
    } finally {
      this._settle();
    }
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._observer.disconnect();
    super.dispose();
  }

  /** Show the live view when the inner renderer holds one, else the snapshot. */
  private _settle(): void {
    if (this.isDisposed || !this._ours) {
      return;
    }
    if (this.live) {
      this._inner.node.style.display = '';
      this._dropSnapshot();
      this.node.dataset.sgnbView = 'live';
    } else {
      this._inner.node.style.display = 'none';
      if (!this._snapshot && this._model) {
        void this._showSnapshot(this._model);
      }
      this.node.dataset.sgnbView = 'snapshot';
    }
  }

  private async _showSnapshot(model: IRenderMime.IMimeModel): Promise<void> {
    this._inner.node.style.display = 'none';
    if (!this._snapshot) {
      this._snapshot = this._registry.createRenderer('text/html');
      this._snapshot.addClass('sgnb-SavedView-snapshot');
      this.insertWidget(0, this._snapshot);
    }
    this.node.dataset.sgnbView = 'snapshot';
    // the snapshot alone: a model whose data is its text/html (the renderer reads it by its own mime type)
    await this._snapshot.renderModel(model);
  }

  private _dropSnapshot(): void {
    if (this._snapshot) {
      this._snapshot.dispose();
      this._snapshot = null;
    }
  }

  private _observer: MutationObserver;
  private _snapshot: IRenderMime.IRenderer | null = null;
  private _model: IRenderMime.IMimeModel | null = null;
  private _liveId = '';
  private _ours = false;
}

/** Wrap `registry.createRenderer` so that widget views get a SavedViewRenderer around the widget manager's. */
export function wrapRegistry(registry: IRegistry): IDisposable {
  const original = registry.createRenderer;
  const wrapped = function (this: IRegistry, mimeType: string): IRenderMime.IRenderer {
    const renderer = original.call(this, mimeType);
    return mimeType === WIDGET_VIEW_MIME ? new SavedViewRenderer(renderer, this) : renderer;
  };
  registry.createRenderer = wrapped;
  return new DisposableDelegate(() => {
    if (registry.createRenderer === wrapped) {
      registry.createRenderer = original;
    }
  });
}

/** The document widget extension: each notebook's rendermime registry wrapped as it is created. */
export class SavedViewsExtension implements DocumentRegistry.IWidgetExtension<NotebookPanel, INotebookModel> {
  createNew(panel: NotebookPanel): IDisposable {
    return wrapRegistry(panel.content.rendermime);
  }
}
