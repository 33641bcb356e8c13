"""`%sgl`: the kernel's engine and backend (load a model, switch backends, watch the cache, serve it)."""

from __future__ import annotations

import argparse
import shlex
import time
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
                       help="smollm2 (default), an HF-format directory, a .gguf file or dummy:<name>")
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
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%sgl: {e}") from None
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(self.sgl.__doc__)
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
        runtime = self.session.load_model(model, **options)
        engine = runtime.engine
        print(f"sgnb: {engine.model_name} on {engine.runner.placement} loaded in {time.perf_counter() - t0:.1f} s "
              f"(KV pool {engine.runner.kv_pool.size} tokens); it is the default backend")

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
        view = show.live_view(name, engine) if self.session.widgets() else None
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


EngineMagics.sgl.__doc__ = f"""The kernel's engine and backend.

Usage:
{_usage_lines()}

Commands:
""" + "\n".join(f"  {name:<8} {text}" for name, text in SUBCOMMANDS.items()) + """

`%sgl model` takes every engine option (`%sgl model -h` lists them); it shuts down the engine it loaded
before. `%%sgl` runs a cell as an LM program on the current backend (`%%sgl?`). Programs anywhere in the
notebook (`fn.run()`) use the same default backend.

Examples:
  %sgl model smollm2 --device cpu
  %sgl model /models/llama --device cuda --dtype bfloat16 --mem-fraction 0.8
  %sgl model /models/llama-70b --device cuda --tp 4       # tensor parallel: one worker process per GPU
  %sgl backend http://localhost:30000
  %sgl tree
  %sgl serve --port 30000
"""
