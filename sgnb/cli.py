"""The `sgnb` command. Subcommands live in `COMMANDS`: name -> (help, add_arguments, run); add one there.

    sgnb serve --model smollm2 --port 30000 [--max-total-tokens N] [--schedule-policy lpm] [--disable-radix-cache]

Every `EngineConfig` field is an option (`--max-total-tokens`, `--chunked-prefill-size`, ...), generated from the
dataclass, so a new engine knob is a new flag with no edit here. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sgnb.engine.config import SCHEDULE_POLICIES, EngineConfig

_NOT_OPTIONS = {"model_path", "extra"}
# SGLang's flag spellings, accepted too
_ALIASES = {"model_path": ["--model", "--model-path"]}
_CHOICES: dict[str, Sequence[str]] = {"schedule_policy": SCHEDULE_POLICIES}


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
                       help="smollm2 (default), an HF-format directory, a .gguf file or dummy:<name>")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_OPTIONS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if str(f.type) == "bool":
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            group.add_argument(flag, dest=f.name, action=action, default=argparse.SUPPRESS,
                               help=f"(default: {default})")
        else:
            choices = _CHOICES.get(f.name)
            group.add_argument(flag, dest=f.name, type=_field_type(f), default=argparse.SUPPRESS, choices=choices,
                               metavar=f.name.upper(),
                               help=(f"one of {', '.join(choices)} " if choices else "") + f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"}
    return {k: v for k, v in vars(args).items() if k in names}


# ---- serve -------------------------------------------------------------------------------------------------
def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (default: 30000)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(parser)


def _serve(args: argparse.Namespace) -> int:
    from sgnb.engine import Engine
    from sgnb.server import serve

    try:
        engine = Engine(**engine_kwargs(args))
    except (TypeError, ValueError) as e:  # an option value the engine rejected
        raise SystemExit(f"sgnb serve: error: {e}") from None
    print(f"sgnb: {engine.model_name} loaded in {engine.load_seconds:.1f} s; serving http://{args.host}:{args.port} "
          "(SGLang native API and OpenAI API under /v1)", file=sys.stderr, flush=True)
    try:
        serve(engine, host=args.host, port=args.port, log_level=args.log_level)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": ("serve a model over HTTP (SGLang native API + OpenAI-compatible API)", _serve_arguments, _serve),
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
