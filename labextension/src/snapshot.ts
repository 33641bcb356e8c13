/**
 * What `sgnb.kernel_ext.panel.snapshot_json()` returns (kernel_ext/panel.py). The tree rows and the stats are
 * in the formats that the widgets' drawing modules document (widgets/radix_tree_draw.js, stats_draw.js).
 */

export interface ISnapshot {
  /** null when the kernel has no in-process engine (no default backend, or a remote one). */
  engine: { model: string; device: string; alive: boolean } | null;
  /** Without an engine: the default backend's class name, or null when there is none. */
  backend?: string | null;
  /** How long the kernel took to make this snapshot. */
  seconds?: number;
  stats?: { [key: string]: unknown };
  history?: { [series: string]: number[] };
  tree?: {
    nodes: ITreeRow[];
    summary: { nodes: number; shown: number; groups: number; tokens: number; [key: string]: unknown };
    details: { [key: string]: unknown };
  };
}

/** A node row or a "+N nodes" group row (`group: true`, id "g<parent>"). */
export interface ITreeRow {
  id: number | string;
  parent: number | null;
  group?: boolean;
  state?: string;
  /** The images / videos in the node's tokens (drawn as thumbnail chips; its text reads "[image]" there). */
  media?: IMedia[];
  [key: string]: unknown;
}

/** An image or video in a node: `tokens` of its pad tokens lie in this node; a small JPEG thumbnail. */
export interface IMedia {
  kind: 'image' | 'video';
  hash: string;
  tokens: number;
  thumbnail: string;
}
