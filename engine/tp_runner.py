"""TPModelRunner: the model sharded over tensor-parallel worker processes; the scheduler stays here.

    engine process (the notebook kernel)            worker rank r (one per GPU, or a CPU rank)
    scheduler, radix cache, KV slot allocator,      shard r of the model (tensor_parallel.py), the K/V
    req_to_token table (the truth), sampler         storage of its KV heads for every slot id, a copy
                                                    of req_to_token; forward in lockstep with the other
                                                    ranks (torch.distributed: NCCL on GPU, gloo on CPU)

Transport: one pipe per worker (torch.multiprocessing, spawn). Per forward the driver pickles one message (the
batch's token ids, positions and new slots as numpy arrays, the per-request lengths, and the req_to_token
entries written since the previous forward, so the workers' copies stay equal to the scheduler's table) and
writes the same bytes to every pipe. Workers keep the hidden states; rank 0 gathers the vocab-parallel logits
of each request's last row (all that sampling needs) and answers with them: written into a shared-memory
buffer (one per kind of call, sized for the largest batch as far as /dev/shm allows) with a small header on
the pipe, or as raw bytes on the pipe when they do not fit. Logits of other rows (prompt logprobs) cost a
second, rarer round trip naming the rows. Only rank 0 answers, except with an error.

Failure: while waiting, the driver watches every worker's pipe and process sentinel. A worker that raises
reports its traceback and exits; one that dies is seen by its sentinel. Either way the runner fails for good
(the ranks' collectives are out of step): the batch in flight fails with a WorkerError naming the rank and the
cause, the remaining workers are killed, and `failure()` makes the engine refuse new requests. Workers ignore
SIGINT (Jupyter interrupts the kernel's whole process group) and exit when their parent does (pipe EOF, and a
thread polling getppid), so killing the kernel leaves no orphans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from sgnb.engine.attention import make_attention_backend, resolve_backend_name
from sgnb.engine.config import EngineConfig, cpu_threads
from sgnb.engine.forward_batch import BatchSpec, ForwardBatch
from sgnb.engine.kv_pool import KVCache, KVPool, ReqToTokenPool
from sgnb.engine.model_loader import ModelSource
from sgnb.engine.model_runner import kv_pool_slots, resolve_device, resolve_dtype
from sgnb.engine.models.registry import build_model, resolve_quantization
from sgnb.engine.tensor_parallel import TPGroup, check_tp_size, shard_layout

if TYPE_CHECKING:
    from sgnb.engine.cuda_graph import DecodeGraphs, ExtendGraphs

log = logging.getLogger("sgnb.engine")

SHM_BUDGET_BYTES = 256 << 20  # at most this much /dev/shm (and at most half of what is free) for logits
LOGITS_CALL_ROWS = 256  # the scheduler's LOGITS_CHUNK: rows of one `logits` call (more go through the pipe)
FAILURE_GRACE_S = 1.0  # after a first failure, how long to wait for the other workers' own reports or deaths
STOP_TIMEOUT_S = 10.0  # a worker told to stop gets this long before it is killed
PARENT_POLL_S = 0.5  # how often a worker checks that the engine's process is still there


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or raised. The runner cannot continue; `rank` is the first culprit."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class RemoteHidden:
    """A forward's hidden states, kept by the workers; here only the logits of each request's last row
    (possibly a view of shared memory: valid until the next forward)."""

    step: int
    num_tokens: int
    rows: dict[int, int]  # row of the batch -> index into `logits`
    logits: torch.Tensor  # (len(rows), vocab) float32


@dataclass(frozen=True)
class _WorkerSpec:
    config: EngineConfig
    source: ModelSource
    rank: int
    size: int
    init_method: str
    parent_pid: int
    context_length: int
    shm: dict[str, torch.Tensor] | None  # rank 0: call kind -> shared float32 buffer for its reply


def _dumps(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Worker environment, unless the user set these. OpenMP threads that spin after each parallel region (the
# default) take the cores the engine's process needs between steps: 6x slower decode on a 2-core machine.
_WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
_env_lock = threading.Lock()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (those not set already) while workers start, then restore: spawned
    processes inherit os.environ at start, and this process's own libraries read it only at load."""
    with _env_lock:
        added = [k for k in values if k not in os.environ]
        for k in added:
            os.environ[k] = values[k]
        try:
            yield
        finally:
            for k in added:
                os.environ.pop(k, None)


def _reply_buffers(vocab: int, rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """Shared-memory float32 buffers for rank 0's replies, (rows x vocab) each, as far as /dev/shm allows."""
    try:
        st = os.statvfs("/dev/shm")
        budget = min(SHM_BUDGET_BYTES, st.f_bavail * st.f_frsize // 2)
    except OSError:
        return {}
    out = {}
    for kind, n in rows.items():
        n = min(n, budget // len(rows) // (4 * vocab))
        if n > 0:
            out[kind] = torch.empty(n * vocab, dtype=torch.float32).share_memory_()
    return out


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TPModelRunner:
    """Runs the model in `config.tp_size` worker processes (see the module docstring); keeps the runner
    contract of model_runner.py. `device` is where the scheduler's tables and the logits live: the CPU."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.source = source
        self.model_config = mcfg = source.config
        self.tp_size = size = config.tp_size
        check_tp_size(mcfg, size)
        worker_device = resolve_device(config.device)
        if worker_device.type == "cuda":
            first = worker_device.index or 0
            if first + size > torch.cuda.device_count():
                raise ValueError(f"tp_size={size} from cuda:{first} needs {first + size} GPUs; torch sees "
                                 f"{torch.cuda.device_count()}")
            where = f"cuda:{first}" if size == 1 else f"cuda:{first}-{first + size - 1}"
        else:
            where = str(worker_device)
        self.worker_device = worker_device
        self.dtype = resolve_dtype(config.dtype, worker_device)
        self.device = torch.device("cpu")
        self.placement = f"{where} ({size} tensor-parallel worker{'s' if size > 1 else ''})"
        self.attention_backend = resolve_backend_name(config.attention_backend, worker_device)  # what workers run
        # workers run every forward eagerly (no CUDA graphs across processes yet)
        self.graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        self.quantization = resolve_quantization(config.quantization, worker_device)
        self.context_length = config.context_length or mcfg.max_position_embeddings
        self._io_lock = threading.Lock()  # one exchange with the workers at a time; pipes are read under it
        self._fatal: WorkerError | None = None
        self._closed = False
        self._step = 0
        self._started = False  # every worker loaded its shard and its KV storage
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

        ctx = torch.multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._shm = _reply_buffers(mcfg.vocab_size, {"forward": config.max_running_requests + 8,
                                                     "logits": LOGITS_CALL_ROWS})
        t0 = time.perf_counter()
        try:
            with _environment(_WORKER_ENV):  # read when the worker's runtime libraries load: before our code
                self._start_workers(ctx, size, init_method)
            with self._io_lock:
                capacity = self._collect(range(size))  # each rank loaded its shard: KV slots it can hold
                slots = min(capacity.values())
                self._send(("init_kv", slots))
                self._collect(range(size))
            self._started = True
        except BaseException:
            self._kill_all()
            self.shutdown()
            raise
        self.kv_pool = KVPool(slots)  # slot ids only: the storage is in the workers
        # the table on the host only: the workers hold the copies their forwards read
        self.req_pool = ReqToTokenPool(config.max_running_requests + 8, self.context_length + 1, torch.device("cpu"),
                                       track_writes=True)
        log.info("model %s on %s/%s in %.1f s, KV pool %d tokens", source.name, self.placement, self.dtype,
                 time.perf_counter() - t0, slots)

    def _start_workers(self, ctx: Any, size: int, init_method: str) -> None:
        for rank in range(size):
            parent_end, child_end = ctx.Pipe()
            spec = _WorkerSpec(self.config, self.source, rank, size, init_method, os.getpid(), self.context_length,
                               self._shm if rank == 0 else None)
            proc = ctx.Process(target=_worker_main, args=(spec, child_end), name=f"sgnb-tp{rank}", daemon=True)
            proc.start()
            child_end.close()  # the worker holds the only other end: its death reads as EOF here
            self._procs.append(proc)
            self._conns.append(parent_end)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- the runner contract --------------------------------------------------------------------------------
    def replays_graph(self, spec: BatchSpec) -> bool:
        return False  # the workers run every forward eagerly

    def forward(self, spec: BatchSpec) -> RemoteHidden:
        """Run the batch on every worker; returns the logits of each request's last row (see RemoteHidden)."""
        rows, cols, vals = self.req_pool.take_writes()
        last_rows = spec.last_rows()
        payload = {"batch": spec.to_wire(), "writes": (rows, cols, vals),
                   "logit_rows": last_rows}
        logits = self._call("forward", payload)
        self._step += 1
        return RemoteHidden(self._step, spec.num_tokens, {r: i for i, r in enumerate(last_rows)}, logits)

    def logits(self, hidden: RemoteHidden, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `rows` of the latest forward: from what came back with it, else from the workers (then
        valid until the next `logits` call)."""
        assert hidden.step == self._step, "the workers keep only the latest forward's hidden states"
        if rows is None:
            if len(hidden.rows) == hidden.num_tokens:  # decode: every row is some request's last
                return hidden.logits
            rows = range(hidden.num_tokens)
        wanted = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        index = [hidden.rows.get(r) for r in wanted]
        if None not in index:
            return hidden.logits[index]
        return self._call("logits", {"rows": wanted})

    def encode(self, item: Any) -> torch.Tensor:
        raise ValueError("images and videos do not run on tensor-parallel workers (tp_size 1 only)")

    def failure(self) -> WorkerError | None:
        """The error that stopped the workers, if any (checks for a dead worker without waiting)."""
        if self._fatal is not None or self._closed:
            return self._fatal
        dead = wait_any([p.sentinel for p in self._procs], timeout=0)
        if not dead or not self._io_lock.acquire(blocking=False):
            return None  # alive, or a call is in flight and will see the death itself
        try:
            return self._fail(next(r for r, p in enumerate(self._procs) if p.sentinel in dead))
        finally:
            self._io_lock.release()

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force). Safe to call twice and after a failure."""
        if self._closed:
            return
        self._closed = True
        if self._io_lock.acquire(timeout=STOP_TIMEOUT_S):
            try:
                if self._fatal is None:
                    for conn in self._conns:
                        try:
                            conn.send_bytes(_dumps(("stop", None)))
                        except OSError:
                            pass
            finally:
                self._io_lock.release()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
        self._kill_all()
        for conn in self._conns:
            conn.close()

    # ---- talking to the workers (under _io_lock) -------------------------------------------------------------
    def _call(self, kind: str, payload: Any) -> torch.Tensor:
        with self._io_lock:
            if self._closed:
                raise WorkerError("the tensor-parallel workers were shut down")
            if self._fatal is not None:
                raise self._fatal
            self._send((kind, payload))
            return self._collect([0])[0]

    def _send(self, msg: tuple) -> None:
        data = _dumps(msg)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:  # broken pipe: the worker is gone
                raise self._fail(rank) from None

    def _collect(self, ranks: Sequence[int]) -> dict[int, Any]:
        """Wait for one reply from each of `ranks`. Anything else (an error report, a death) fails the runner."""
        pending, got = set(ranks), {}
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            ready = wait_any([*self._conns, *sentinel_rank])
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):  # pipes first: last words before death
                if isinstance(obj, int):
                    rank = sentinel_rank[obj]
                    if not self._conns[rank].poll():
                        raise self._fail(rank)
                    continue  # it said something before dying: read it next round
                rank = conn_rank[id(obj)]
                obj = cast(Connection, obj)  # not a sentinel: one of our pipes
                try:
                    kind, body = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    raise self._fail(rank) from None
                except Exception as e:  # whatever garbage came down the pipe
                    raise self._fail(rank, f"protocol error: unreadable message ({e!r})") from None
                if kind == "error":
                    raise self._fail(rank, body)
                if kind == "shm":  # float32 logits in the shared buffer of this kind of call
                    which, shape = body
                    body = self._shm[which][: int(np.prod(shape))].view(*shape)
                elif kind == "tensor":  # float32 logits as raw bytes in the next message: no copies
                    buf = bytearray(4 * int(np.prod(body)))
                    try:
                        obj.recv_bytes_into(buf)
                    except (EOFError, OSError):
                        raise self._fail(rank) from None
                    body = torch.frombuffer(buf, dtype=torch.float32).view(*body)
                if rank not in pending:
                    raise self._fail(rank, f"protocol error: unexpected {kind!r} message")
                got[rank] = body
                pending.discard(rank)
        return got

    def _fail(self, rank: int, report: str | None = None) -> WorkerError:
        """Record the failure (once), kill every worker, and return the error to raise."""
        if self._fatal is not None:
            return self._fatal
        reports = {rank: report} if report is not None else {}
        # the first sign may be a consequence (a peer's collective breaking when a rank dies): give the others
        # a moment to report or die, so the error names the cause first
        deadline = time.monotonic() + FAILURE_GRACE_S
        while True:
            for r, conn in enumerate(self._conns):
                try:
                    while r not in reports and conn.poll():
                        kind, body = pickle.loads(conn.recv_bytes())
                        if kind == "error":
                            reports[r] = body
                except Exception:  # EOF, or leftovers of a reply: only error reports matter
                    pass
            alive = [p for r, p in enumerate(self._procs) if r not in reports and p.exitcode is None]
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                break
            wait_any([p.sentinel for p in alive] + [self._conns[self._procs.index(p)] for p in alive], timeout=left)
        died = {r: p.exitcode for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)}  # before we kill
        self._kill_all()
        causes, first = [], None
        for r, code in died.items():  # deaths without a word first: a crash, the OOM killer, kill -9
            if r not in reports:
                causes.append(f"tensor-parallel worker rank {r} (pid {self._procs[r].pid}) {_exit_text(code)}")
                first = r if first is None else first
        for r, text in sorted(reports.items()):
            last = text.strip().splitlines()[-1] if text.strip() else "an error"
            last = last if len(last) <= 200 else last[:200] + "..."
            then = "then " if causes else ""  # after a death: most likely its collective breaking
            causes.append(f"{then}tensor-parallel worker rank {r} (pid {self._procs[r].pid}) raised {last}")
            first = r if first is None else first
            log.error("tensor-parallel worker rank %d failed:\n%s", r, text)
        if not causes:
            causes.append(f"tensor-parallel worker rank {rank} (pid {self._procs[rank].pid}) closed its pipe")
            first = rank
        hint = " The workers are stopped: shut the engine down and load the model again."
        if not self._started and died and not reports:
            hint = (" A worker that dies before it loads the model often means a script that creates the Engine "
                    "outside `if __name__ == \"__main__\":` (workers are spawned: they import the main module "
                    "again); its output above says why.")
        self._fatal = WorkerError("; ".join(causes) + "." + hint, rank=first)
        log.error("%s", self._fatal)
        return self._fatal

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)


# ---- the worker process -------------------------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the engine's process is gone (even while blocked in a collective or a kernel)."""
    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="sgnb-parent-watch", daemon=True).start()


def _worker_main(spec: _WorkerSpec, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook interrupt is for the kernel, not for us
    _exit_with_parent(spec.parent_pid)
    try:
        worker = _Worker(spec)
        conn.send_bytes(_dumps(("ready", worker.kv_capacity)))
        kind, slots = pickle.loads(conn.recv_bytes())
        assert kind == "init_kv", kind
        worker.init_kv(slots)
        conn.send_bytes(_dumps(("ok", None)))
        with torch.inference_mode():
            worker.serve(conn)
    except EOFError:  # the engine's process closed the pipe (or died): nothing to report to
        os._exit(0)
    except BaseException:
        text = traceback.format_exc()
        try:
            conn.send_bytes(_dumps(("error", text)))  # the engine logs it and raises it to the caller
        except OSError:
            print(f"sgnb tensor-parallel worker rank {spec.rank} failed:\n{text}", flush=True)
        os._exit(1)  # the other ranks may be stuck in a collective: no orderly teardown


class _Worker:
    """One rank: its shard of the model, the K/V storage of its heads, and a copy of req_to_token."""

    def __init__(self, spec: _WorkerSpec) -> None:
        self.spec = spec
        config, mcfg = spec.config, spec.source.config
        device = resolve_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + spec.rank)
            torch.cuda.set_device(device)
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast: off
        else:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
        torch.set_num_threads(max(1, cpu_threads(config.num_threads) // spec.size))  # cores / tp
        self.device = device
        self.dtype = resolve_dtype(config.dtype, device)
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, device)
        group = None
        if spec.size > 1:
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                                 init_method=spec.init_method, world_size=spec.size, rank=spec.rank)
            group = torch.distributed.group.WORLD
        self.layout = shard_layout(mcfg, spec.rank, spec.size)
        self.model: Any = build_model(mcfg, spec.source, device, self.dtype, spec.context_length,  # (model_runner's)
                                 TPGroup(self.layout, group), seed=config.random_seed,
                                 quantization=resolve_quantization(config.quantization, device))
        self.kv_capacity = kv_pool_slots(config, mcfg, self.kv_dtype, device, self.layout.num_kv_heads,
                                         spec.context_length)
        self.kv_cache: KVCache | None = None
        self.req_to_token: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def init_kv(self, slots: int) -> None:
        mcfg = self.spec.source.config
        self.kv_cache = KVCache(slots, mcfg.num_hidden_layers, self.layout.num_kv_heads, mcfg.head_dim,
                                self.kv_dtype, self.device)
        self.attn = make_attention_backend(self.spec.config.attention_backend, self.kv_cache, self.layout.num_heads,
                                           self.layout.num_kv_heads, mcfg.head_dim, self.device)
        self.req_to_token = torch.zeros(self.spec.config.max_running_requests + 8, self.spec.context_length + 1,
                                        dtype=torch.int64, device=self.device)

    def serve(self, conn: Connection) -> None:
        handlers = {"forward": self.forward, "logits": self.logits}
        while True:
            kind, payload = pickle.loads(conn.recv_bytes())
            if kind == "stop":
                if self.spec.size > 1:
                    torch.distributed.destroy_process_group()
                return
            out = handlers[kind](payload)
            if self.spec.rank != 0:
                continue
            assert out is not None  # rank 0 holds the logits
            shm = (self.spec.shm or {}).get(kind)
            if shm is not None and out.numel() <= shm.numel():
                shm[: out.numel()].view_as(out).copy_(out)  # (rows, vocab) float32
                conn.send_bytes(_dumps(("shm", (kind, tuple(out.shape)))))
            else:
                logits = out.cpu().numpy()  # (rows, vocab) float32, C-contiguous
                conn.send_bytes(_dumps(("tensor", logits.shape)))
                conn.send_bytes(logits)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs lack __buffer__ before 3.12

    def forward(self, p: dict[str, Any]) -> torch.Tensor | None:
        assert self.req_to_token is not None and self.kv_cache is not None
        dev = self.device
        rows, cols, vals = (torch.from_numpy(a).to(dev) for a in p["writes"])
        self.req_to_token[rows, cols] = vals  # now equal to the scheduler's table
        fb = ForwardBatch.build(BatchSpec.from_wire(p["batch"]), self.req_to_token, dev)
        fb.attn_backend = self.attn
        self.attn.init_forward_metadata(fb)
        self.hidden = self.model(fb)  # (T, hidden), the same on every rank
        return self.model.compute_logits(self.hidden[p["logit_rows"]])  # (R, vocab) on rank 0, else None

    def logits(self, p: dict[str, Any]) -> torch.Tensor | None:
        assert self.hidden is not None
        return self.model.compute_logits(self.hidden[p["rows"]])
