"""The `sgnb` command. Subcommands live in `COMMANDS`: name -> (help, add_arguments, run); add one there.

    sgnb serve --model smollm2 --port 30000 [--served-model-name NAME] [--strict-model-name] [--max-total-tokens N]
    sgnb run NB.ipynb [-p KEY=VALUE ...] [--backend URL] [-o out.ipynb|out.html] [--timeout S]
    sgnb run NB.ipynb --function F --input in.jsonl [-o out.jsonl] [--backend URL | --model M ...] [--num-threads N]
    sgnb export EXECUTED.ipynb [-o page.html | -o out.ipynb]

Every `EngineConfig` field is an option (`--max-total-tokens`, `--chunked-prefill-size`, ...), generated from the
dataclass, so a new engine knob is a new flag with no edit here. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sgnb.engine.config import ATTENTION_BACKENDS, SCHEDULE_POLICIES, EngineConfig

_NOT_OPTIONS = {"model_path", "extra"}
# SGLang's flag spellings, accepted too
_ALIASES = {"model_path": ["--model", "--model-path"], "tp_size": ["--tp-size", "--tp", "--tensor-parallel-size"]}
_CHOICES: dict[str, Sequence[str]] = {"schedule_policy": SCHEDULE_POLICIES, "attention_backend": ATTENTION_BACKENDS}
_HELP = {"tp_size": "tensor parallelism: shard the model over N worker processes (one per GPU; gloo ranks on CPU) ",
         "tp_workers": "run the model in a worker process even at tp size 1 ",
         "revision": "of a hub id: a branch, tag or commit (default main) "}


def _field_type(f: dataclasses.Field) -> Callable[[str], Any]:
    kind = str(f.type)  # annotations are strings here (from __future__ import annotations)
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --model and one option per EngineConfig field. Only options given end up in `engine_kwargs`."""
    group = parser.add_argument_group("engine (EngineConfig)")
    group.add_argument(*_ALIASES["model_path"], dest="model_path", default="smollm2",
                       help="smollm2 (default), a hub id (org/name, from the Hugging Face cache), an HF-format "
                            "directory, a .gguf file or dummy:<name>")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_OPTIONS:
            continue
        flags = _ALIASES.get(f.name, ["--" + f.name.replace("_", "-")])
        default = f.default if f.default is not dataclasses.MISSING else None
        if str(f.type) == "bool":
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            group.add_argument(*flags, dest=f.name, action=action, default=argparse.SUPPRESS,
                               help=_HELP.get(f.name, "") + f"(default: {default})")
        else:
            choices = _CHOICES.get(f.name)
            group.add_argument(*flags, dest=f.name, type=_field_type(f), default=argparse.SUPPRESS, choices=choices,
                               metavar=f.name.upper(),
                               help=(f"one of {', '.join(choices)} " if choices else "") + _HELP.get(f.name, "")
                               + f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"}
    return {k: v for k, v in vars(args).items() if k in names}


# ---- serve -------------------------------------------------------------------------------------------------
def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (default: 30000)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in /v1/models, /get_model_info and every response (default: the "
                             "model's own, e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--strict-model-name", action="store_true",
                        help="answer a request whose \"model\" is not the served name with OpenAI's 404 "
                             "model_not_found (default: as SGLang, any name is served by the one model)")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="the model's reasoning format, by SGLang's parser names (qwen3, deepseek-r1, gpt-oss, "
                             "mistral, ...): chat completions return the thinking as reasoning_content and apply a "
                             "response_format / regex from the end of the reasoning on")
    access = parser.add_argument_group("access and limits")
    access.add_argument("--api-key", default=os.environ.get("SGNB_API_KEY"),
                        help="every route but /health needs Authorization: Bearer KEY (also $SGNB_API_KEY). "
                             "Without a key only requests for this host or a loopback name are answered")
    access.add_argument("--admin-api-key", default=os.environ.get("SGNB_ADMIN_API_KEY"),
                        help="the key the admin routes (flush_cache, abort_request) need instead "
                             "(also $SGNB_ADMIN_API_KEY)")
    access.add_argument("--allowed-hosts", default="", metavar="HOST[,HOST]",
                        help="Host / Origin names answered without a key besides the bound address and loopback "
                             "('*': any)")
    access.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                        help="largest request body (default 8 MiB; larger is a 413)")
    access.add_argument("--max-n", type=int, default=None, metavar="N", help="samples per prompt (default 64)")
    access.add_argument("--max-samples", type=int, default=None, metavar="N",
                        help="samples per request, prompts x n (default 512)")
    access.add_argument("--max-top-logprobs-num", type=int, default=None, metavar="N",
                        help="top_logprobs_num on /generate (default 64; the OpenAI routes allow 20)")
    access.add_argument("--request-read-timeout", type=float, default=None, metavar="SECONDS",
                        help="seconds a connection has to send a whole request, head and body (default 30); a "
                             "slower one is closed")
    parser.add_argument("--shutdown-grace", type=float, default=None, metavar="SECONDS",
                        help="on Ctrl-C / SIGTERM, how long requests in flight may run on before they are aborted "
                             "(a stream then ends with a 503 error event; default 5)")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="as SGLang's flag: /generate stream chunks carry only the new text, output ids and "
                             "output logprobs (default: the text and logprobs so far)")
    add_engine_arguments(parser)


def server_options(args: argparse.Namespace) -> Any:
    """The ServerOptions the serve flags ask for."""
    from sgnb.server import ServerOptions

    given = {"max_request_bytes": args.max_request_bytes, "max_n": args.max_n, "max_samples": args.max_samples,
             "max_top_logprobs_num": args.max_top_logprobs_num, "shutdown_grace": args.shutdown_grace,
             "request_read_timeout": args.request_read_timeout}
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    return ServerOptions(api_key=args.api_key or None, admin_api_key=args.admin_api_key or None,
                         allowed_hosts=hosts, incremental_streaming_output=args.incremental_streaming_output,
                         strict_model_name=args.strict_model_name, **{k: v for k, v in given.items() if v is not None})


def serve_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine's arguments for `sgnb serve`: the EngineConfig options given, and the serving ones the engine
    keeps (served_model_name, reasoning_parser)."""
    return {**engine_kwargs(args), "served_model_name": args.served_model_name,
            "reasoning_parser": args.reasoning_parser}


def _serve(args: argparse.Namespace) -> int:
    from sgnb.engine import Engine
    from sgnb.server import serve

    try:
        options = server_options(args)  # bad flags fail before the model loads
    except ValueError as e:
        raise SystemExit(f"sgnb serve: error: {e}") from None
    try:
        engine = Engine(**serve_engine_kwargs(args))
    except (TypeError, ValueError) as e:  # an option value the engine rejected
        raise SystemExit(f"sgnb serve: error: {e}") from None
    print(f"sgnb: {engine.model_name} loaded in {engine.load_seconds:.1f} s; serving http://{args.host}:{args.port} "
          "(SGLang native API and OpenAI API under /v1)", file=sys.stderr, flush=True)
    def terminate(signum: int, frame: Any) -> None:  # SIGTERM ends the server as Ctrl-C does: gracefully
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # (uvicorn re-raises the signal after its shutdown: land here)
    try:
        serve(engine, host=args.host, port=args.port, log_level=args.log_level, options=options)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0


# ---- run ---------------------------------------------------------------------------------------------------
def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebook", help="the notebook (.ipynb)")
    parser.add_argument("-p", "--parameter", action="append", default=[], metavar="KEY=VALUE",
                        help="set a variable: a cell assigning it is inserted after the cell tagged `parameters` "
                             "(else first); VALUE is a Python literal if it reads as one, else a string")
    parser.add_argument("--backend", metavar="SPEC",
                        help="run against this backend: http(s)://HOST:PORT (sgnb serve, an SGLang server), "
                             "openai:MODEL or anthropic:MODEL; the notebook's `%%sgl model` then keeps it")
    parser.add_argument("-o", "--output", metavar="PATH",
                        help="the executed notebook (.ipynb) or its HTML page (.html: the views work offline); "
                             "with --function, the JSONL results (default: stdout)")
    parser.add_argument("--timeout", type=float, default=600, metavar="S",
                        help="seconds a cell may run (default: 600; 0: no limit)")
    parser.add_argument("--kernel", default="python3", help="kernel name (default: python3)")
    data = parser.add_argument_group("dataset mode: one program over a JSONL file, with run_batch")
    data.add_argument("--function", metavar="NAME", help="the notebook's @function to run (the notebook's "
                                                         "definitions are imported: sgnb.load_notebook)")
    data.add_argument("--input", metavar="JSONL", help="one JSON object of NAME's arguments per line (- : stdin)")
    data.add_argument("--num-threads", type=int, default=None, metavar="N", help="programs at once (default: auto)")
    data.add_argument(*_ALIASES["model_path"], dest="model_path", default="smollm2",
                      help="without --backend: the in-process engine's model (default: smollm2)")
    data.add_argument("--device", default=argparse.SUPPRESS, help="without --backend: cpu, cuda, ... (default: auto)")
    data.add_argument("--dtype", default=argparse.SUPPRESS, help="without --backend: the engine's dtype")


def _run(args: argparse.Namespace) -> int:
    from sgnb.headless import parse_parameter

    if (args.function is None) != (args.input is None):
        raise SystemExit("sgnb run: error: --function and --input go together")
    try:
        parameters = dict(parse_parameter(p) for p in args.parameter)
    except ValueError as e:
        raise SystemExit(f"sgnb run: error: {e}") from None
    if args.function is not None:
        if parameters:
            raise SystemExit("sgnb run: error: -p sets notebook variables; it does not apply with --function")
        return _run_dataset(args)
    return _run_notebook(args, parameters)


def _run_notebook(args: argparse.Namespace, parameters: dict[str, Any]) -> int:
    import time
    from pathlib import Path

    import nbformat
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    from sgnb.export import write_notebook
    from sgnb.headless import execute, inject_parameters

    path = Path(args.notebook)
    if args.output and Path(args.output).suffix.lower() not in (".ipynb", ".html", ".htm"):
        raise SystemExit(f"sgnb run: error: -o takes a .ipynb or .html path, got {args.output!r}")
    try:
        nb = nbformat.read(str(path), as_version=4)
    except (OSError, ValueError) as e:
        raise SystemExit(f"sgnb run: error: cannot read {path}: {e}") from None
    inject_parameters(nb, parameters)
    t0 = time.perf_counter()
    failure: BaseException | None = None
    try:
        execute(nb, path.resolve().parent, args.backend, args.timeout or None, args.kernel)
    except (CellExecutionError, DeadKernelError, TimeoutError) as e:
        failure = e
    elapsed = time.perf_counter() - t0
    if args.output:
        out = write_notebook(nb, args.output)
        print(f"sgnb run: wrote {out}", file=sys.stderr)
    cells = sum(c.cell_type == "code" for c in nb.cells)
    if failure is not None:
        print(f"sgnb run: {path} failed after {elapsed:.1f} s:\n{failure}", file=sys.stderr)
        return 1
    print(f"sgnb run: {path}: {cells} code cells ran in {elapsed:.1f} s", file=sys.stderr)
    return 0


def _run_dataset(args: argparse.Namespace) -> int:
    import json
    import time

    import sgnb
    from sgnb.function import SglFunction
    from sgnb.headless import backend_from_spec, read_jsonl, run_dataset
    from sgnb.notebook_import import load_notebook

    module = load_notebook(args.notebook)
    fn = getattr(module, args.function, None)
    if not isinstance(fn, SglFunction):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, SglFunction))
        raise SystemExit(f"sgnb run: error: {args.notebook} defines no @function {args.function!r} "
                         f"(it defines: {', '.join(found) or 'none'})")
    try:
        if args.input == "-":
            rows = read_jsonl(sys.stdin)
        else:
            with open(args.input, encoding="utf-8") as f:
                rows = read_jsonl(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"sgnb run: error: {args.input}: {e}") from None
    t0 = time.perf_counter()
    try:
        options = {k: v for k, v in vars(args).items() if k in ("model_path", "device", "dtype")}
        backend = backend_from_spec(args.backend) if args.backend else sgnb.Runtime(**options)
    except (TypeError, ValueError, sgnb.BackendError) as e:
        raise SystemExit(f"sgnb run: error: {e}") from None
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115
    errors = 0
    try:
        for record in run_dataset(fn, rows, backend, num_threads=args.num_threads or "auto"):
            errors += record["error"] is not None
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
        if not args.backend:
            backend.shutdown()
    where = f" -> {args.output}" if args.output else ""
    print(f"sgnb run: {args.function} over {len(rows)} inputs in {time.perf_counter() - t0:.1f} s, "
          f"{errors} failed{where}", file=sys.stderr)
    return 1 if errors else 0  # every row is in the output either way; a failed row makes the run fail


# ---- export ------------------------------------------------------------------------------------------------
def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebook", help="an executed notebook (.ipynb) with its widget state: from sgnb run, "
                                         "nbclient, or JupyterLab with the widget manager's saveState on")
    parser.add_argument("-o", "--output", metavar="PATH",
                        help="a page whose views need no network (.html; default: the notebook's path with .html), "
                             "or a notebook (.ipynb, the same path too) whose views' static snapshots show the saved "
                             "state, for GitHub and nbviewer")


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import nbformat

    from sgnb.export import saved_widget_state, write_notebook

    path = Path(args.notebook)
    out = Path(args.output) if args.output else path.with_suffix(".html")
    if out.suffix.lower() not in (".ipynb", ".html", ".htm"):
        raise SystemExit(f"sgnb export: error: -o takes a .html or .ipynb path, got {args.output!r}")
    try:
        nb = nbformat.read(str(path), as_version=4)
    except (OSError, ValueError) as e:
        raise SystemExit(f"sgnb export: error: cannot read {path}: {e}") from None
    write_notebook(nb, out)
    saved = "" if saved_widget_state(nb) else " (the notebook saved no widget state: any view shows its snapshot)"
    print(f"sgnb export: wrote {out}{saved}", file=sys.stderr)
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": ("serve a model over HTTP (SGLang native API + OpenAI-compatible API)", _serve_arguments, _serve),
    "run": ("run a notebook headless (parameters, HTML export), or one of its programs over a JSONL dataset",
            _run_arguments, _run),
    "export": ("an executed notebook as an HTML page whose views work offline (or as .ipynb with up-to-date static "
               "snapshots of its views)", _export_arguments, _export),
}


def build_parser() -> argparse.ArgumentParser:
    from sgnb import __version__

    parser = argparse.ArgumentParser(prog="sgnb", description="sgnb: LM programs on an in-process RadixAttention "
                                                              "engine")
    parser.add_argument("--version", action="version", version=f"sgnb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
