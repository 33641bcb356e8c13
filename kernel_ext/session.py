"""KernelSession: what the extension keeps for one kernel.

The engine `%sgl model` loaded (the session owns it: it shuts it down when replaced or unloaded), the server
`%sgl serve` started over an engine, the live views that watch an engine, and the backend a headless run pins
(`sgnb run --backend`, through SGNB_BACKEND). The current backend itself is sgnb's default backend, so a plain
`fn.run()` in the notebook uses whatever `%sgl model` / `%sgl backend` chose.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

import sgnb
from sgnb.backends.base import Backend, BackendError
from sgnb.headless import BACKEND_ENV, backend_from_spec, pinned_backend


class KernelSession:
    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.runtime: Any = None  # the Runtime `%sgl model` loaded; this session shuts it down
        self.server: Any = None  # sgnb.server.ServerThread
        self.served_engine: Any = None
        self.views: list[tuple[Any, Any]] = []  # (engine, view) pairs, detached when the engine goes
        self.use_widgets: bool | None = None  # None: widgets in a notebook, text elsewhere
        self.pinned = pinned_backend()
        self._by_spec: dict[str, Backend] = {}
        self._cell_files: set[str] = set()
        if self.pinned:
            sgnb.set_default_backend(self.backend_for(self.pinned))

    # ---- backends ----------------------------------------------------------------------------------------
    def backend(self) -> Backend:
        backend = sgnb.get_default_backend()
        if backend is None:
            raise UsageError("no backend yet: `%sgl model smollm2` loads the in-process engine, "
                             "`%sgl backend URL` uses a server")
        return backend

    def backend_for(self, spec: str, **options: Any) -> Backend:
        """A backend from a spec (URL, openai:MODEL, anthropic:MODEL) or from the name of a user variable
        holding a Backend or an Engine. Remote backends are made once per spec and reused."""
        value = self.shell.user_ns.get(spec) if spec.isidentifier() else None
        if isinstance(value, Backend):
            return value
        if value is not None and hasattr(value, "tree_snapshot") and hasattr(value, "generate"):
            return sgnb.Runtime(engine=value)
        if value is not None:
            raise UsageError(f"{spec} is a {type(value).__name__}, not a backend or an engine")
        key = spec + repr(sorted(options.items()))
        if key not in self._by_spec:
            try:
                self._by_spec[key] = backend_from_spec(spec, **options)
            except ValueError as e:
                raise UsageError(str(e)) from None
            except BackendError as e:  # e.g. no server answers at that URL
                raise UsageError(f"cannot use {spec}: {e}") from None
        return self._by_spec[key]

    def engine(self) -> Any:
        """The in-process engine behind the current backend."""
        engine = getattr(self.backend(), "engine", None)
        if engine is None:
            raise UsageError(f"the current backend ({type(self.backend()).__name__}) is not an in-process engine: "
                             "`%sgl model smollm2` loads one")
        return engine

    def load_model(self, model: str, progress: Any = None, **options: Any) -> Any:
        """Load `sgnb.Runtime(model, **options)` and make it the default backend, replacing the engine this
        session loaded before. The model and options are checked first, so a typo leaves the working engine in
        place; on a GPU the old engine is then shut down before the new one loads (its memory is needed), on a
        CPU only once the new one has loaded. `progress(label, seconds)` hears of each phase (see Engine)."""
        import time

        t0 = time.perf_counter()
        if progress is not None:
            progress("importing torch and the engine", None)
        from sgnb.engine import Engine  # noqa: F401 (torch and the engine: a second or two the first time)
        from sgnb.engine.config import EngineConfig
        from sgnb.engine.model_loader import resolve_model

        if progress is not None:
            progress("importing torch and the engine", time.perf_counter() - t0)
        try:
            config = EngineConfig.from_kwargs(model_path=model, **options)
            t0 = time.perf_counter()
            label = "finding the model (a GGUF is converted once, then cached)"  # as the engine names it
            if progress is not None:
                progress(label, None)
            resolve_model(model, cache_dir=config.cache_dir, revision=config.revision)
            if progress is not None:
                progress(label, time.perf_counter() - t0)
        except (TypeError, ValueError, FileNotFoundError) as e:
            raise UsageError(f"%sgl model: {e} (the current backend is unchanged)") from None
        on_gpu = config.device.startswith("cuda") or (config.device == "auto" and _cuda_available())
        if on_gpu:
            self.release_runtime()
        try:
            runtime = sgnb.Runtime(model, **options, **({"progress": progress} if progress else {}))
        except (TypeError, ValueError, FileNotFoundError) as e:
            raise UsageError(f"%sgl model: {e}") from None
        if not on_gpu:
            self.release_runtime()
        self.runtime = runtime
        sgnb.set_default_backend(runtime)
        return runtime

    def release_runtime(self) -> None:
        """Shut down the engine `%sgl model` loaded, with the server and views over it."""
        runtime, self.runtime = self.runtime, None
        if runtime is None:
            return
        self.release_engine(runtime.engine)
        if sgnb.get_default_backend() is runtime:
            sgnb.set_default_backend(None)
        runtime.shutdown()

    def release_engine(self, engine: Any) -> None:
        if self.served_engine is engine:
            self.stop_server()
        for eng, view in list(self.views):
            if eng is engine:
                self.views.remove((eng, view))
                detach = getattr(view, "detach", None)
                if detach is not None:
                    detach()

    # ---- server, views, cells ----------------------------------------------------------------------------
    def start_server(self, engine: Any, host: str, port: int, api_key: str | None = None) -> Any:
        from sgnb.server import ServerOptions, start_server_thread

        self.stop_server()
        try:
            self.server = start_server_thread(engine, host, port, options=ServerOptions(api_key=api_key))
        except OSError as e:
            raise UsageError(f"%sgl serve: cannot listen on {host}:{port}: {e}") from None
        self.served_engine = engine
        return self.server

    def stop_server(self) -> None:
        server, self.server, self.served_engine = self.server, None, None
        if server is not None:
            server.stop()

    def watch(self, engine: Any, view: Any) -> None:
        self.views.append((engine, view))

    def widgets(self) -> bool:
        from sgnb.kernel_ext.display import in_notebook

        return in_notebook(self.shell) if self.use_widgets is None else self.use_widgets

    def cell_number(self) -> int:
        """N of the running cell's `In [N]`: IPython (9.x, and ipykernel) counts the cell before running it."""
        return max(self.shell.execution_count - 1, 1)

    def cell_filename(self, number: int | None = None, reserve: bool = True) -> str:
        """`<sgl-cell-N>` for input N (the running cell's unless `number` is given); unique even when a cell runs
        several times under one number. With `reserve=False` the name is only looked up: the next call for N
        returns it again."""
        n = self.cell_number() if number is None else number
        name, k = f"<sgl-cell-{n}>", 1
        while name in self._cell_files:
            k += 1
            name = f"<sgl-cell-{n}.{k}>"
        if reserve:
            self._cell_files.add(name)
        return name

    def describe(self) -> str:
        backend = sgnb.get_default_backend()
        if backend is None:
            lines = ["backend: none"]
        else:
            owner = " (loaded by %sgl model)" if backend is self.runtime else ""
            try:
                model = backend.get_model_name()
            except Exception as e:  # a remote backend that cannot answer right now
                model = f"? ({e})"
            lines = [f"backend: {type(backend).__name__} {model}{owner}"]
        if self.pinned:
            lines.append(f"pinned by {BACKEND_ENV}={self.pinned} (%sgl model keeps it)")
        if self.server is not None:
            lines.append(f"serving: {self.server.url}")
        return "\n".join(lines)

    def close(self) -> None:
        self.stop_server()
        for _, view in self.views:
            detach = getattr(view, "detach", None)
            if detach is not None:
                detach()
        self.views.clear()
        self.release_runtime()
        for backend in self._by_spec.values():  # the backends this session made from specs
            if sgnb.get_default_backend() is backend:
                sgnb.set_default_backend(None)
            backend.shutdown()
        self._by_spec.clear()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
