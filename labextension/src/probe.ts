/**
 * Asks a notebook's kernel for its engine snapshot.
 *
 * One silent execute request per poll, whose `user_expressions` call `sgnb.kernel_ext.panel.snapshot_json()`
 * (it returns a str whose repr is the JSON itself, so the reply's `text/plain` parses as JSON). On a kernel
 * with JEP 91 subshells (ipykernel >= 7) the requests go to a subshell of our own, so they are answered while
 * the main shell runs a cell; elsewhere they queue behind running cells and the panel updates between cells.
 * Silent requests add nothing to the history and leave the execution count alone. The kernel still publishes
 * a busy/idle status for each, which JupyterLab shows as the kernel's status (the status bar may read "Idle"
 * while a cell runs; the notebook's execution indicator is not affected).
 */
import { IDisposable } from '@lumino/disposable';
import { Kernel, KernelMessage } from '@jupyterlab/services';

import { ISnapshot } from './snapshot';

/** How the kernel should lay out the tree (node ids of the engine's tree). */
export interface IProbeOptions {
  collapsed?: number[];
  expanded?: number[];
  selected?: number | null;
}

/** The Python expression evaluated in the kernel (imports sgnb on first use: cheap, no torch). */
export function snapshotExpression(options: IProbeOptions = {}): string {
  const ids = (xs: number[] = []) => `[${xs.filter(Number.isInteger).join(', ')}]`;
  const selected = Number.isInteger(options.selected) ? String(options.selected) : 'None';
  return (
    "__import__('sgnb.kernel_ext.panel', fromlist=['snapshot_json']).snapshot_json(" +
    `collapsed=${ids(options.collapsed)}, expanded=${ids(options.expanded)}, selected=${selected})`
  );
}

/** Thrown when the kernel answered but could not evaluate the expression (e.g. it has no sgnb). */
export class ProbeError extends Error {}

export class EngineProbe implements IDisposable {
  constructor(readonly kernel: Kernel.IKernelConnection) {}

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** Whether the requests go to a subshell (known after the first `fetch`). */
  get onSubshell(): boolean {
    return (this._clone?.subshellId ?? null) !== null;
  }

  /** One snapshot. Rejects with ProbeError when the kernel could not evaluate the expression. */
  async fetch(options: IProbeOptions = {}): Promise<ISnapshot> {
    const conn = await this._connection();
    const future = conn.requestExecute({
      code: '',
      silent: true,
      store_history: false,
      allow_stdin: false,
      stop_on_error: false,
      user_expressions: { sgnb: snapshotExpression(options) }
    });
    const reply = (await future.done) as KernelMessage.IExecuteReplyMsg;
    const content = reply.content;
    if (content.status !== 'ok') {
      throw new ProbeError(`the kernel answered "${content.status}"`);
    }
    const result = content.user_expressions['sgnb'] as
      | { status: string; data?: { 'text/plain'?: string }; ename?: string; evalue?: string }
      | undefined;
    if (!result || result.status !== 'ok' || typeof result.data?.['text/plain'] !== 'string') {
      throw new ProbeError(result?.ename ? `${result.ename}: ${result.evalue}` : 'no snapshot in the reply');
    }
    return JSON.parse(result.data['text/plain']) as ISnapshot;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    if (this._clone) {
      try {
        this._clone.dispose(); // deletes our subshell
      } catch (err) {
        console.warn('sgnb: could not close the panel subshell', err);
      }
      this._clone = null;
    }
  }

  private _connection(): Promise<Kernel.IKernelConnection> {
    if (!this._conn) {
      this._conn = this._open();
    }
    return this._conn;
  }

  /**
   * A connection of our own (a clone: its requests do not show in the notebook's execution indicator, which
   * counts the execute requests of the notebook's connection), on a subshell of our own when the kernel has
   * them.
   */
  private async _open(): Promise<Kernel.IKernelConnection> {
    await this.kernel.info;
    const clone = this.kernel.clone({ handleComms: false });
    if (this.kernel.supportsSubshells) {
      try {
        const reply = await this.kernel.requestCreateSubshell({}).done;
        clone.subshellId = reply.content.subshell_id; // disposing the clone deletes the subshell
      } catch (err) {
        console.warn('sgnb: no subshell for the LM engine panel; asking the main shell', err);
      }
    }
    if (this._disposed) {
      clone.dispose(); // disposed while we waited
    } else {
      this._clone = clone;
    }
    return clone;
  }

  private _conn: Promise<Kernel.IKernelConnection> | null = null;
  private _clone: Kernel.IKernelConnection | null = null;
  private _disposed = false;
}
