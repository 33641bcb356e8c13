/**
 * The "LM engine" side panel: the live radix tree and engine stats of the active notebook's kernel.
 *
 * While visible it polls the kernel (`EngineProbe`) every POLL_MS (longer when a snapshot takes the kernel
 * more than a tenth of that), one request in flight at a time, and draws each snapshot with the widgets' own
 * drawing modules (radix_tree_draw.js, stats_draw.js), so the panel and the notebook widgets look and behave
 * alike. It follows the notebook tracker's current notebook: focusing the panel keeps the last one. Folding,
 * opening "+N nodes" groups and selecting a node are sent along with the next request, and the kernel lays
 * the tree out accordingly. The tree starts with "fit width" on (a tree deeper than the panel's width allows
 * for columns is drawn as an outline, so the narrow panel does not scroll sideways) and "follow newest" on
 * (the most recently inserted node is kept in view, and the root's row stays pinned in view while the root is
 * scrolled out); both are toggles in the tree's header.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { drawTree } from '@sgnb/widgets/radix_tree_draw.js';
import { drawStats } from '@sgnb/widgets/stats_draw.js';

import { EngineProbe, IProbeOptions, ProbeError } from './probe';
import { ISnapshot } from './snapshot';

/** Poll period while the panel is visible (2.5 Hz). */
export const POLL_MS = 400;

/** The share of the kernel's time the snapshots may take (they hold the GIL that the engine's scheduler
 * thread needs): the wait after a snapshot that took s seconds is at least s * (1 / share - 1). The same
 * budget as the notebook views' timer threads (widgets/_ticker.py). */
export const KERNEL_SHARE = 0.02;

export class EnginePanel extends Widget {
  constructor(private readonly _tracker: INotebookTracker) {
    super();
    this.id = 'sgnb-engine-panel';
    this.addClass('sgnb-EnginePanel');
    this.title.caption = 'LM engine: radix tree and stats of the active notebook kernel';

    this._header = document.createElement('div');
    this._header.className = 'sgnb-EnginePanel-header';
    this._status = document.createElement('div');
    this._status.className = 'sgnb-EnginePanel-status';
    this._statsHost = document.createElement('div');
    this._statsHost.className = 'sgnb-EnginePanel-stats';
    this._treeHost = document.createElement('div');
    this._treeHost.className = 'sgnb-EnginePanel-tree';
    this.node.append(this._header, this._status, this._statsHost, this._treeHost);
    this._setStatus('idle', 'Open a notebook to see its LM engine.');

    _tracker.currentChanged.connect(this._onNotebookChanged, this);
    this._onNotebookChanged();
  }

  /** The latest snapshot drawn (undefined before the first one). */
  get snapshot(): ISnapshot | undefined {
    return this._snapshot;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._stop();
    this._follow(null);
    this._clearDrawing();
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    this._schedule(0);
  }

  protected onAfterHide(msg: Message): void {
    this._stop();
    this._resetProbe(); // frees the kernel subshell while nobody looks
  }

  // ---- which kernel ---------------------------------------------------------------------------------------
  private _onNotebookChanged(): void {
    const current = this._tracker.currentWidget;
    if (current && current !== this._notebook) {
      this._follow(current);
    } else if (!current && !this._notebook) {
      this._renderHeader();
    }
  }

  private _follow(notebook: NotebookPanel | null): void {
    if (this._notebook) {
      const ctx = this._notebook.sessionContext;
      ctx.kernelChanged.disconnect(this._onKernelChanged, this);
      ctx.statusChanged.disconnect(this._onKernelStatus, this);
      this._notebook.disposed.disconnect(this._onNotebookDisposed, this);
    }
    this._notebook = notebook;
    this._resetProbe();
    this._resetView();
    if (notebook) {
      const ctx = notebook.sessionContext;
      ctx.kernelChanged.connect(this._onKernelChanged, this);
      ctx.statusChanged.connect(this._onKernelStatus, this);
      notebook.disposed.connect(this._onNotebookDisposed, this);
    }
    this._renderHeader();
    this._schedule(0);
  }

  private _onNotebookDisposed(): void {
    this._follow(this._tracker.currentWidget);
  }

  private _onKernelChanged(): void {
    this._resetProbe();
    this._resetView();
    this._renderHeader();
    this._schedule(0);
  }

  private _onKernelStatus(ctx: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      this._resetProbe();
      this._resetView();
      this._clearDrawing();
      this._setStatus('idle', `Kernel ${status}.`);
    }
  }

  private _resetProbe(): void {
    this._probe?.dispose();
    this._probe = null;
  }

  /** Forget folds and selection: node ids belong to one engine. */
  private _resetView(): void {
    this._collapsed.clear();
    this._expanded.clear();
    this._selected = null;
    this._snapshot = undefined;
  }

  // ---- polling --------------------------------------------------------------------------------------------
  private _schedule(delay: number = POLL_MS): void {
    if (this.isDisposed || !this.isVisible || this._inFlight) {
      return;
    }
    this._stop();
    this._timer = window.setTimeout(() => {
      this._timer = 0;
      void this._poll();
    }, delay);
  }

  private _stop(): void {
    if (this._timer !== 0) {
      window.clearTimeout(this._timer);
      this._timer = 0;
    }
  }

  private async _poll(): Promise<void> {
    const kernel = this._notebook?.sessionContext.session?.kernel ?? null;
    if (!kernel) {
      this._clearDrawing();
      this._setStatus('idle', this._notebook ? 'No kernel.' : 'Open a notebook to see its LM engine.');
      return; // kernelChanged reschedules
    }
    if (!this._probe || this._probe.kernel !== kernel) {
      this._probe?.dispose();
      this._probe = new EngineProbe(kernel);
    }
    const probe = this._probe;
    const options: IProbeOptions = {
      collapsed: [...this._collapsed],
      expanded: [...this._expanded],
      selected: this._selected
    };
    this._inFlight = true;
    let wait = POLL_MS;
    try {
      const snap = await probe.fetch(options);
      wait = Math.max(POLL_MS, 1000 * (snap.seconds ?? 0) * (1 / KERNEL_SHARE - 1));
      if (probe === this._probe && !this.isDisposed) {
        this._draw(snap);
      }
    } catch (err) {
      if (probe === this._probe && !this.isDisposed) {
        const why = err instanceof ProbeError ? err.message : String(err);
        this._setStatus('error', `No engine snapshot: ${why}`);
      }
    } finally {
      this._inFlight = false;
    }
    this._schedule(this._again ? 0 : wait);
    this._again = false;
  }

  /** Ask again as soon as the request in flight (if any) is answered: the view changed. */
  private _refresh(): void {
    if (this._inFlight) {
      this._again = true;
    } else {
      this._schedule(0);
    }
  }

  // ---- drawing --------------------------------------------------------------------------------------------
  private _renderHeader(): void {
    const nb = this._notebook;
    const kernel = nb?.sessionContext.session?.kernel;
    this._header.textContent = nb ? `${nb.title.label}${kernel ? ` · ${kernel.name}` : ''}` : 'No notebook';
  }

  private _draw(snap: ISnapshot): void {
    this._snapshot = snap;
    const tree = snap.tree;
    if (snap.engine === null || !tree) {
      const remote = snap.backend ? ` (the default backend, ${snap.backend}, runs elsewhere)` : '';
      this._setStatus(
        'no-engine',
        `No in-process engine${remote}. In a notebook cell: %load_ext sgnb, then %sgl model smollm2.`
      );
      this._clearDrawing();
      return;
    }
    const e = snap.engine;
    const where = this._probe?.onSubshell ? '' : ' · updates between cells';
    const dead = e.alive ? '' : ' (shut down)';
    this._setStatus(e.alive ? 'live' : 'stopped', `${e.model} on ${e.device}${dead}${where}`);
    this.node.dataset.nodes = String(Math.max(tree.summary.nodes - 1, 0)); // the root caches nothing
    this._drawn = true;
    drawStats(this._statsHost, { stats: snap.stats ?? {}, history: snap.history ?? {} });
    drawTree(
      this._treeHost,
      {
        nodes: tree.nodes,
        summary: tree.summary,
        collapsed: [...this._collapsed],
        selected: this._selected,
        details: tree.details
      },
      {
        select: id => {
          this._selected = typeof id === 'number' ? id : null;
          this._refresh();
        },
        toggle: id => {
          if (typeof id === 'number') {
            if (!this._collapsed.delete(id)) {
              this._collapsed.add(id);
            }
            this._refresh();
          }
        },
        expandGroup: parentId => {
          this._expanded.add(parentId);
          this._refresh();
        }
      },
      { fit: true, follow: true }
    );
  }

  private _clearDrawing(): void {
    this.node.dataset.nodes = '0';
    if (this._drawn) {
      drawTree(this._treeHost, { nodes: [] }).destroy();
      drawStats(this._statsHost, { stats: {}, history: {} }).destroy();
      this._drawn = false;
    }
  }

  private _setStatus(state: string, text: string): void {
    this.node.dataset.status = state;
    this._status.textContent = text;
  }

  private _notebook: NotebookPanel | null = null;
  private _probe: EngineProbe | null = null;
  private _snapshot: ISnapshot | undefined = undefined;
  private _timer = 0;
  private _inFlight = false;
  private _again = false;
  private _drawn = false;
  private readonly _collapsed = new Set<number>();
  private readonly _expanded = new Set<number>();
  private _selected: number | null = null;
  private readonly _header: HTMLDivElement;
  private readonly _status: HTMLDivElement;
  private readonly _statsHost: HTMLDivElement;
  private readonly _treeHost: HTMLDivElement;
}
