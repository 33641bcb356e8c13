/**
 * The widgets' drawing modules (widgets/*.js in the Python package), bundled as they are: webpack.config.js
 * maps `@sgnb/widgets` to that folder. Their header comments document the state they draw; the panel builds
 * that state from `sgnb.kernel_ext.panel.snapshot_json()`.
 */
declare module '@sgnb/widgets/radix_tree_draw.js' {
  export interface ITreeCallbacks {
    select?(id: number | string | null): void;
    toggle?(id: number | string): void;
    expandGroup?(parentId: number): void;
  }
  export function drawTree(
    container: HTMLElement,
    state: {
      nodes: unknown[];
      summary?: { [key: string]: unknown };
      collapsed?: Array<number | string>;
      selected?: number | string | null;
      details?: { [key: string]: unknown };
    },
    callbacks?: ITreeCallbacks,
    options?: ITreeOptions
  ): { destroy(): void };
  /** Read when the first call builds the view: the toggles' initial states, and whether to show them. */
  export interface ITreeOptions {
    fit?: boolean;
    follow?: boolean;
    zoom?: boolean;
    controls?: boolean;
  }
}

declare module '@sgnb/widgets/stats_draw.js' {
  export function drawStats(
    container: HTMLElement,
    state: { stats: { [key: string]: unknown }; history: { [name: string]: number[] } }
  ): { destroy(): void };
}
