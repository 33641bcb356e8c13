"""`%sgl`: the kernel's engine and backend (load a model, switch backends, watch the cache, serve it), and its
Tab completion (`complete_line`, registered with the kernel's completer by `register_completion`)."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable, Mapping
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.display import display

import sgnb
from sgnb.kernel_ext import display as show
from sgnb.kernel_ext.session import KernelSession

SUBCOMMANDS = {
    "model": "load the in-process engine (sgnb.Runtime) and make it the default backend",
    "backend": "use another backend: URL (sgnb serve / SGLang server), openai:MODEL, anthropic:MODEL, "
               "or a variable holding a backend or an engine",
    "tree": "show the current engine's radix tree, live",
    "stats": "show the current engine's statistics, live",
    "flush": "empty the current backend's prefix cache",
    "serve": "serve the kernel's engine over HTTP (SGLang + OpenAI APIs) so other clients share its cache",
    "status": "show the current backend (and server)",
}


def build_parser() -> MagicArgumentParser:
    from sgnb.cli import add_engine_arguments

    plain = argparse.HelpFormatter  # IPython's MagicHelpFormatter is for docstrings; these print as they are
    parser = MagicArgumentParser(prog="%sgl", description="the kernel's engine and backend", formatter_class=plain)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=MagicArgumentParser)
    cmds = {name: sub.add_parser(name, help=text, description=text, formatter_class=plain)
            for name, text in SUBCOMMANDS.items()}
    model = cmds["model"]
    model.usage = ("%(prog)s [MODEL] [--device cpu|cuda] [--dtype DTYPE] [--mem-fraction F] "
                   "[--max-total-tokens N] [--tp N] [ENGINE OPTION ...]")
    model.add_argument("model", nargs="?", metavar="MODEL",
                       help="smollm2 (default), a hub id (org/name, from the Hugging Face cache), an HF-format "
                            "directory, a .gguf file or dummy:<name>")
    model.add_argument("--mem-fraction", dest="mem_fraction_static", type=float, default=argparse.SUPPRESS,
                       metavar="F", help="GPU memory fraction for weights + KV cache (mem_fraction_static)")
    add_engine_arguments(model)
    backend = cmds["backend"]
    backend.add_argument("spec", metavar="SPEC", help="http(s)://HOST:PORT | openai:MODEL | anthropic:MODEL | NAME")
    backend.add_argument("--base-url", default=None, help="for openai:MODEL: an OpenAI-compatible server")
    serve = cmds["serve"]
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000, help="port (default: 30000; 0 picks a free one)")
    serve.add_argument("--stop", action="store_true", help="stop serving")
    serve.add_argument("--api-key", default=None,
                       help="require Authorization: Bearer KEY on every route but /health (needed to answer other hosts)")
    return parser


PARSER = build_parser()
_COMMAND_PARSERS: dict[str, MagicArgumentParser] = next(
    a.choices for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))


def _usage_lines() -> str:
    return "\n".join("  " + p.format_usage().replace("usage: ", "").strip() for p in _COMMAND_PARSERS.values())


@magics_class
class EngineMagics(Magics):
    def __init__(self, shell: Any, session: KernelSession) -> None:
        super().__init__(shell)
        self.session = session

    @no_var_expand
    @line_magic
    def sgl(self, line: str = "") -> None:
        __tracebackhide__ = True  # noqa: F841 (IPython hides this frame in tracebacks)
        try:
            argv = shlex.split(line, comments=True)  # "# ..." after the arguments is a comment
        except ValueError as e:
            raise UsageError(f"%sgl: {e}") from None
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(EngineMagics.sgl.__doc__)
            print(self.session.describe())
            return
        if argv[0] in _COMMAND_PARSERS and any(a in ("-h", "--help") for a in argv[1:]):
            print(_COMMAND_PARSERS[argv[0]].format_help())
            return
        if argv[0] not in _COMMAND_PARSERS:
            raise UsageError(f"%sgl: unknown command {argv[0]!r}; one of {', '.join(SUBCOMMANDS)} (`%sgl?` for help)")
        args = PARSER.parse_args(argv)
        getattr(self, "_" + args.command)(args)

    # ---- subcommands --------------------------------------------------------------------------------------
    def _model(self, args: argparse.Namespace) -> None:
        from sgnb.cli import engine_kwargs

        options = engine_kwargs(args)
        model = args.model or options.pop("model_path")
        options.pop("model_path", None)
        if self.session.pinned:
            print(f"sgnb: the backend is pinned to {self.session.pinned} (SGNB_BACKEND, set by `sgnb run "
                  f"--backend`): not loading {model}")
            return
        t0 = time.perf_counter()
        progress = show.LoadProgress(f"sgnb: loading {model}", live=show.in_notebook(self.shell))
        runtime = self.session.load_model(model, progress=progress, **options)
        engine = runtime.engine
        progress.finish(f"sgnb: {engine.model_name} on {engine.runner.placement} loaded in "
                        f"{time.perf_counter() - t0:.1f} s (KV pool {engine.runner.kv_pool.size} tokens); it is the "
                        "default backend")

    def _backend(self, args: argparse.Namespace) -> None:
        options = {"base_url": args.base_url} if args.base_url else {}
        if options and not args.spec.startswith("openai:"):
            raise UsageError("--base-url goes with openai:MODEL")
        backend = self.session.backend_for(args.spec, **options)
        sgnb.set_default_backend(backend)
        print(f"sgnb: default backend is {type(backend).__name__} {backend.get_model_name()}")

    def _tree(self, args: argparse.Namespace) -> None:
        self._view("RadixTreeView", show.tree_text)

    def _stats(self, args: argparse.Namespace) -> None:
        self._view("EngineStats", show.stats_text)

    def _view(self, name: str, text: Any) -> None:
        engine = self.session.engine()
        view = show.live_view(name, engine, keep_current=True) if self.session.widgets() else None
        if view is None:
            display(text(engine))
        else:
            self.session.watch(engine, view)

    def _flush(self, args: argparse.Namespace) -> None:
        if self.session.backend().flush_cache():
            print("sgnb: prefix cache flushed")
        else:
            print("sgnb: the cache was not flushed (the backend cannot, or requests are in flight)")

    def _serve(self, args: argparse.Namespace) -> None:
        if args.stop:
            was = self.session.server
            self.session.stop_server()
            print(f"sgnb: stopped serving {was.url}" if was else "sgnb: not serving")
            return
        engine = self.session.engine()
        server = self.session.start_server(engine, args.host, args.port, args.api_key)
        key = args.api_key or "none"
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"sgnb: serving {engine.model_name} at {server.url} (the kernel's engine and cache)\n"
              f"  SGLang frontend: sgl.RuntimeEndpoint({server.url!r}" + (f", api_key={key!r})" if args.api_key else ")")
              + f"\n  OpenAI client:   openai.OpenAI(base_url={server.url + '/v1'!r}, api_key={key!r})\n"
              f"  curl {server.url}/generate -H 'Content-Type: application/json'{auth} -d '{{\"text\": \"Hello\", "
              f"\"sampling_params\": {{\"max_new_tokens\": 16}}}}'\n"
              f"  stop with %sgl serve --stop")

    def _status(self, args: argparse.Namespace) -> None:
        print(self.session.describe())


# ---- completion ----------------------------------------------------------------------------------------------
BACKEND_FORMS = ("http://127.0.0.1:30000", "openai:", "anthropic:")


def model_aliases() -> list[str]:
    """The model names `%sgl model` takes that are not paths: the default model's aliases, the hub ids in the
    local Hugging Face cache and the dummy shapes."""
    from sgnb.engine.hub import cached_model_ids
    from sgnb.engine.model_loader import SMOLLM2_NAME, dummy_config_names

    return ["smollm2", SMOLLM2_NAME, *cached_model_ids(), *(f"dummy:{name}" for name in dummy_config_names())]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings if flag.startswith("--")}


def _backend_names(user_ns: Mapping[str, Any]) -> list[str]:
    """The user's variables `%sgl backend NAME` accepts: backends and in-process engines."""
    from sgnb.backends.base import Backend

    def usable(value: Any) -> bool:
        return isinstance(value, Backend) or type(value).__module__ == "sgnb.engine.engine"

    return sorted(k for k, v in list(user_ns.items()) if not k.startswith("_") and usable(v))


def complete_line(before: str, user_ns: Mapping[str, Any]) -> tuple[str, list[str]] | None:
    """Tab completion of a `%sgl` line (or a `%%sgl` cell's first line), given its text up to the cursor: the word
    being completed and its candidates, or None when the line is none of ours. The first word completes to a
    subcommand, `--...` to that subcommand's options, an option's value to its choices, `%sgl model ...` to
    the model aliases (a path is left to IPython's file completion: no candidates), `%sgl backend ...` to the
    backend forms and the user's variables holding a backend or an engine."""
    words = before.split()
    if not words or words[0] not in ("%sgl", "%%sgl"):
        return None
    current = "" if before[-1:].isspace() else words.pop()
    if not words:  # the cursor is still on "%sgl" itself: IPython completes magic names
        return None
    args = words[1:]  # the words before the one being completed
    if words[0] == "%%sgl":
        from sgnb.kernel_ext.program_magics import ProgramMagics
        from sgnb.state import ProgramState

        if args and args[-1] in ("-i", "--input"):  # a state to continue
            return current, sorted(k for k, v in list(user_ns.items())
                                   if isinstance(v, ProgramState) and k.startswith(current))
        return current, _option_candidates(ProgramMagics.sgl.parser, args, current)
    if not args:
        return current, [c for c in (*SUBCOMMANDS, "help") if c.startswith(current)]
    parser = _COMMAND_PARSERS.get(args[0])
    if parser is None:
        return current, []
    candidates = _option_candidates(parser, args[1:], current)
    if candidates or current.startswith("-") or _takes_value(parser, args[1:]):
        return current, candidates
    positional = _positionals(parser, args[1:])
    if args[0] == "model" and not positional:
        names = model_aliases()
    elif args[0] == "backend" and not positional:
        names = [*BACKEND_FORMS, *_backend_names(user_ns)]
    else:
        names = []
    return current, [n for n in names if n.lower().startswith(current.lower())]


def _positionals(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """The words of `args` that are not options or an option's value."""
    options, out, skip = _options(parser), [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            action = options.get(a.split("=", 1)[0])
            skip = "=" not in a and action is not None and action.nargs != 0
        else:
            out.append(a)
    return out


def _takes_value(parser: argparse.ArgumentParser, args: list[str]) -> bool:
    action = _options(parser).get(args[-1]) if args else None
    return action is not None and action.nargs != 0


def _option_candidates(parser: argparse.ArgumentParser, args: list[str], current: str) -> list[str]:
    """`--...` options of `parser` for `current`, or the choices of the option just before it."""
    options = _options(parser)
    if current.startswith("-"):
        return sorted(f for f in options if f.startswith(current))
    action = options.get(args[-1]) if args else None
    if action is not None and action.choices:
        return [str(c) for c in action.choices if str(c).startswith(current)]
    return []


def register_completion(shell: Any) -> Callable[[], None]:
    """Add `%sgl` completion to the shell's completer (a Matcher API v2 matcher that takes over the lines
    `complete_line` answers); returns the function that removes it."""
    completer = getattr(shell, "Completer", None)
    if completer is None or not hasattr(completer, "custom_matchers"):
        return lambda: None
    from IPython.core.completer import SimpleCompletion, context_matcher

    @context_matcher()
    def sgl_matcher(context: Any) -> dict[str, Any]:
        try:
            found = complete_line(context.text_until_cursor, shell.user_ns)
        except Exception:  # completion must never raise into the frontend
            found = None
        if not found or not found[1]:  # (no candidates cannot suppress the others: a path gets IPython's files)
            return {"completions": [], "suppress": False}
        fragment, names = found
        return {"completions": [SimpleCompletion(n, type="sgl") for n in names], "matched_fragment": fragment,
                "suppress": True, "ordered": True}

    completer.custom_matchers.append(sgl_matcher)

    def remove() -> None:
        if sgl_matcher in completer.custom_matchers:
            completer.custom_matchers.remove(sgl_matcher)

    return remove


EngineMagics.sgl.__doc__ = f"""The kernel's engine and backend.

Usage:
{_usage_lines()}

Commands:
""" + "\n".join(f"  {name:<8} {text}" for name, text in SUBCOMMANDS.items()) + """

`%sgl model` takes every engine option (`%sgl model -h` lists them); it shuts down the engine it loaded
before. `%%sgl` runs a cell as an LM program on the current backend (`%%sgl?`). Programs anywhere in the
notebook (`fn.run()`) use the same default backend. Tab completes commands, options and model names
(`%sgl mo<Tab>`, `%sgl model sm<Tab>`).

Examples:
  %sgl model smollm2 --device cpu
  %sgl model /models/llama --device cuda --dtype bfloat16 --mem-fraction 0.8
  %sgl model /models/llama-70b --device cuda --tp 4       # tensor parallel: one worker process per GPU
  %sgl backend http://localhost:30000
  %sgl tree
  %sgl serve --port 30000
"""
