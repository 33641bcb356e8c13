/**
 * `%%sgl` cells in the editor.
 *
 * JupyterLab 4 has no cell-magic modes: every code cell of a notebook gets the kernel's language (IPython ->
 * CodeMirror's Python parser), so the body of a `%%sgl` cell, which is Python, is already parsed as Python;
 * the Lezer parser recovers after the `%%sgl ...` line, which it reads as stray operators. This extension
 * makes the rest right: the magic line is marked as one `sgnb-cell-magic` span (styled like IPython's
 * magics), the editor gets the `sgnb-sgl-cell` class, and tokens also carry CodeMirror's stable `tok-*`
 * classes (`tok-keyword`, `tok-string`, ...) besides JupyterLab's theme classes.
 */
import { syntaxHighlighting } from '@codemirror/language';
import { EditorState, Extension, Prec, RangeSetBuilder } from '@codemirror/state';
import { Decoration, DecorationSet, EditorView, ViewPlugin, ViewUpdate } from '@codemirror/view';
import { classHighlighter } from '@lezer/highlight';

/** The first line of a cell run by the `%%sgl` magic. */
export const SGL_MAGIC = /^%%sgl(\s|$)/;

export function isSglCell(state: EditorState): boolean {
  return SGL_MAGIC.test(state.doc.line(1).text);
}

const magicMark = Decoration.mark({ class: 'sgnb-cell-magic' });

function magicDecorations(state: EditorState): DecorationSet {
  const builder = new RangeSetBuilder<Decoration>();
  if (isSglCell(state)) {
    const line = state.doc.line(1);
    builder.add(line.from, line.to, magicMark);
  }
  return builder.finish();
}

const magicLine = ViewPlugin.fromClass(
  class {
    decorations: DecorationSet;
    constructor(view: EditorView) {
      this.decorations = magicDecorations(view.state);
    }
    update(update: ViewUpdate): void {
      if (update.docChanged) {
        this.decorations = magicDecorations(update.state);
      }
    }
  },
  { decorations: plugin => plugin.decorations }
);

/** The CodeMirror extension for every code editor (notebook cells, consoles, files). */
export function sglCellExtension(): Extension {
  return [
    Prec.lowest(magicLine), // lowest precedence = outermost: the magic line stays one span around the tokens
    EditorView.editorAttributes.compute(['doc'], (state): { [name: string]: string } =>
      isSglCell(state) ? { class: 'sgnb-sgl-cell' } : {}
    ),
    syntaxHighlighting(classHighlighter)
  ];
}
