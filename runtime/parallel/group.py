"""A tensor-parallel group: N rank processes on torch.distributed, one engine loop on each.

Launch: the command itself starts ranks 1..N-1 with ``torch.multiprocessing`` (spawn) and is rank 0,
or ``torchrun`` starts every rank and each reads its place from the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR / MASTER_PORT). NCCL when every rank has a GPU of its own, gloo otherwise (CPU,
or ranks sharing one GPU); ``TIERED_MOE_DIST_BACKEND`` overrides.

Every rank runs the same ``Engine`` over its own model slice and store slice (shard.py). Rank 0 drives:
what changes the engine's state from outside - a request added, aborted or forgotten, a step - it
queues and broadcasts before each step (vLLM's "rank 0 schedules and broadcasts"), and every rank
applies the same commands in the same order. Inside a step the ranks need no coordination beyond the
all-reduces of the forward: routing is computed from the same residual stream on every rank, so the
scheduler, the prefetcher and placement decide the same on every rank (the store's ``deterministic``
mode takes timing out of its decisions). Sampling happens once, on rank 0, and the tokens are
broadcast (``Scheduler.token_sync``), so no rank can pick another token. A rank that fails inside a
step breaks the group (its peers would wait in a collective): the error ends every rank, and a server
restarts the whole group.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import RuntimeConfig
from ..engine.kv_manager import KVManager
from ..model.config import MoEConfig
from ..proc import watch_parent
from ..store.shared import HostShare, shm_dir
from .shard import Shard, plan, stage_layers

# Seconds a collective may wait for a peer before the group is declared broken.
DEFAULT_TIMEOUT_S = float(os.environ.get("TIERED_MOE_GROUP_TIMEOUT", "600"))
# An idle driver still talks to its workers this often (their wait for the next command stays short of
# the timeout, and a dead rank 0 is noticed).
IDLE_SYNC_S = 1.0


@dataclass
class Rank:
    """One process of a group of ``tp`` tensor-parallel ranks x ``pp`` pipeline stages (rank = stage x tp +
    tensor-parallel rank): its place, its device and what it holds. ``plan`` (shard.py), ``layers`` (the model
    layers of its stage) and ``moe`` (their MoE layers) are set once the model's config is known; ``share``:
    how it joins its node's shared host tier; ``pipe``: its stage's hand-over (None with one stage)."""
    rank: int = 0
    world: int = 1
    tp: int = 1
    pp: int = 1
    device: "str | None" = None
    plan: object = None
    share: object = None
    backend: str = "none"
    layers: "tuple | None" = None
    moe: "tuple | None" = None
    pipe: object = None
    pg_tp: object = None       # the stage's tensor-parallel process group (None: the whole world)
    dead: object = None        # rank 0 of a spawned group: callable() -> [(rank, exit code)] of exited ranks

    @property
    def driver(self) -> bool:
        return self.rank == 0

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def source(self) -> int:
        """The rank that samples: the last stage's first (it has the logits)."""
        return (self.pp - 1) * self.tp

    def broken(self, e: Exception) -> "GroupError":
        """The error a failed collective becomes: which rank is gone, where that is known."""
        gone = self.dead() if callable(self.dead) else []
        who = ", ".join(f"rank {r} exited with code {c}" for r, c in gone) or "a peer rank failed or stalled"
        return GroupError(f"the tensor-parallel group broke ({who}): {str(e).splitlines()[0] if str(e) else type(e).__name__}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the stage's tensor-parallel ranks, in place."""
        try:
            dist.all_reduce(t, group=self.pg_tp)
        except RuntimeError as e:
            raise self.broken(e) from None
        return t

    def barrier(self, stage: bool = False) -> None:
        """Until every rank (``stage``: of this stage) is here."""
        try:
            dist.barrier(group=self.pg_tp if stage else None)
        except RuntimeError as e:
            raise self.broken(e) from None

    def broadcast(self, obj=None, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=src)
        except RuntimeError as e:
            raise self.broken(e) from None
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's ``obj`` on every rank, by rank."""
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except RuntimeError as e:
            raise self.broken(e) from None
        return out

    def min(self, values: list) -> list:
        """The smallest of each value over every rank."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device if self.backend == "nccl" else "cpu")
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as e:
            raise self.broken(e) from None
        return t.cpu().tolist()

    def gather(self, obj) -> "list | None":
        """Every rank's ``obj``, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.driver else None
        try:
            dist.gather_object(obj, out, dst=0)
        except RuntimeError as e:
            raise self.broken(e) from None
        return out


class GroupError(RuntimeError):
    """A collective failed: a rank died or stalled. The group cannot go on (its ranks' states may differ)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(world: int, local_world: int) -> str:
    want = os.environ.get("TIERED_MOE_DIST_BACKEND")
    if want:
        return want
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def device_for(local_rank: int) -> "str | None":
    """A rank's device: its own GPU where there are enough, else they share (round robin); None: CPU."""
    if not torch.cuda.is_available():
        return None
    return f"cuda:{local_rank % torch.cuda.device_count()}"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class Pipe:
    """A pipeline stage's hand-over: hidden states from the stage before (``recv``) and to the stage after
    (``send``, non-blocking: the stage goes on with its next micro-batch; ``flush`` waits for them), each
    between the ranks of the same tensor-parallel place."""

    def __init__(self, rank: Rank, stages: int) -> None:
        self.rank, self.stages = rank, stages
        self.prev = rank.rank - rank.tp if rank.stage > 0 else None
        self.next = rank.rank + rank.tp if rank.stage < stages - 1 else None
        self.pending: list = []

    def recv(self, shape: tuple, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.rank.device or "cpu")
        try:
            dist.recv(t, src=self.prev)
        except RuntimeError as e:
            raise self.rank.broken(e) from None
        return t

    def send(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        try:
            self.pending.append((dist.isend(t, dst=self.next), t))
        except RuntimeError as e:
            raise self.rank.broken(e) from None

    def flush(self) -> None:
        try:
            for work, _ in self.pending:
                work.wait()
        except RuntimeError as e:
            raise self.rank.broken(e) from None
        finally:
            self.pending = []


def _init(rank: int, world: int, local_rank: int, local_world: int, init_method: str, token: str,
          tp: int, pp: int) -> Rank:
    if tp * pp != world:
        raise ValueError(f"{world} ranks are not --tensor-parallel {tp} x --pipeline-parallel {pp}")
    backend = backend_for(world, local_world)
    dev = device_for(local_rank)
    if dev is not None:
        torch.cuda.set_device(dev)
    kw = {"device_id": torch.device(dev)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=DEFAULT_TIMEOUT_S), **kw)
    r = Rank(rank=rank, world=world, tp=tp, pp=pp, device=dev, backend=backend)
    if pp > 1:     # one tensor-parallel group per stage (every rank creates every group, in the same order)
        for s in range(pp):
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == r.stage:
                r.pg_tp = g
        r.pipe = Pipe(r, pp)
    token = r.broadcast(token)          # one name for the whole group (torchrun ranks each made their own)
    # The stage's ranks share their node's host tier (tensor parallelism stays inside a node).
    r.share = HostShare(path=os.path.join(shm_dir(), f"tiered-moe-host-{token}-s{r.stage}"), create=r.tp_rank == 0,
                        rank=r.tp_rank, ranks=tp, barrier=lambda: r.barrier(stage=True))
    return r


# -- starting ranks ---------------------------------------------------------------------------------
def _worker_entry(rank: int, world: int, init_method: str, token: str, cfg: dict, ready, tp: int, pp: int) -> None:
    """A spawned rank: join the group, load its slice, run the engine loop rank 0 drives."""
    code = 0
    watch_parent(os.getppid())    # rank 0's process gone (killed by a supervisor): end too
    try:
        ready.put(rank)                 # imported and alive: rank 0 may start the rendezvous
        r = _init(rank, world, rank, world, init_method, token, tp, pp)
        Worker(r, cfg).run()
    except Exception as e:  # noqa: BLE001 - reported, and the exit code tells the driver
        print(f"tiered-moe rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    os._exit(code)


class Group:
    """Rank 0's handle on the group: start it, load a model, build the engine, stop it."""

    def __init__(self, cfg, *, start: bool = True) -> None:
        """``cfg``: the RuntimeConfig (runtime/config.py); its ``tensor_parallel`` x ``pipeline_parallel`` is the
        group's size."""
        self.cfg, self.procs = cfg, []
        self.tp, self.pp = cfg.tensor_parallel, cfg.pipeline_parallel
        self.world = self.tp * self.pp
        self.rank: "Rank | None" = None
        self.engine = None
        if start:
            self.start()

    def start(self) -> "Group":
        cfg = dataclasses.asdict(self.cfg)
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != self.world:
                raise ValueError(f"torchrun started {world} ranks, --tensor-parallel {self.tp} x --pipeline-parallel "
                                 f"{self.pp} needs {self.world}")
            rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            r = _init(rank, world, local, local_world, "env://", uuid.uuid4().hex, self.tp, self.pp)
            if rank != 0:        # a torchrun worker: serve rank 0's commands, then leave
                code = 0
                try:
                    Worker(r, cfg).run()
                except Exception as e:  # noqa: BLE001
                    print(f"tiered-moe rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    code = 1
                dist.destroy_process_group()
                sys.exit(code)
            self.rank = r
            return self
        import torch.multiprocessing as mp
        init = f"tcp://127.0.0.1:{_free_port()}"
        token = uuid.uuid4().hex
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        for rank in range(1, self.world):
            p = ctx.Process(target=_worker_entry, args=(rank, self.world, init, token, cfg, ready, self.tp, self.pp),
                            name=f"tiered-moe-rank-{rank}", daemon=True)
            p.start()
            self.procs.append(p)
        try:
            self._wait_ready(ready)
            self.rank = _init(0, self.world, 0, self.world, init, token, self.tp, self.pp)
            self.rank.dead = lambda: [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode is not None]
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self, ready, timeout: float = 300.0) -> None:
        """Until every spawned rank has started (a rank that dies on the way is reported, not waited for)."""
        import queue
        left, deadline = set(range(1, self.world)), time.monotonic() + timeout
        while left:
            try:
                left.discard(ready.get(timeout=0.2))
            except queue.Empty:
                dead = [i + 1 for i, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"tensor-parallel rank {dead[0]} exited while starting (exit code "
                                       f"{self.procs[dead[0] - 1].exitcode}); its error is above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel ranks {sorted(left)} did not start within {timeout:.0f} s")

    def load(self, progress: bool = False, cfg=None):
        """Rank 0's (model, store); every other rank loads its own slice at the same time. ``cfg``: another
        configuration of the same group size (a group serves one model at a time: the ranks drop the one
        they held)."""
        if cfg is not None:
            if (cfg.tensor_parallel, cfg.pipeline_parallel) != (self.tp, self.pp):
                raise ValueError(f"a group of TP {self.tp} x PP {self.pp} ranks cannot load a --tensor-parallel "
                                 f"{cfg.tensor_parallel} x --pipeline-parallel {cfg.pipeline_parallel} configuration")
            self.cfg = cfg
        self.rank.broadcast(("load", dataclasses.asdict(self.cfg), progress))
        return _load(self.rank, self.cfg, progress)

    def make_engine(self, model, store, **kw) -> "GroupEngine":
        """The engine on every rank (``kw`` as RuntimeConfig.engine takes them); rank 0's, wrapped."""
        self.rank.broadcast(("engine", kw))
        eng = _engine(self.rank, self.cfg, model, store, kw)
        self.engine = GroupEngine(eng, self.rank)
        return self.engine

    def alive(self) -> list:
        """Ranks whose process has exited (spawned ranks only)."""
        return [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]

    def close(self) -> None:
        """Stop every rank (each returns from its loop and exits) and leave the group."""
        if self.rank is not None and dist.is_initialized():
            try:
                self.rank.broadcast([("stop",)])
            except Exception:  # noqa: BLE001 - a broken group: the processes are killed below
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def open_group(group: "Group | None", cfg, progress: bool = False) -> tuple:
    """(group, rank 0's model, its store) with ``cfg`` loaded: a new group when ``group`` is None, else the
    given one (same size) loading ``cfg`` - the ranks drop the model they held."""
    if group is None:
        group = Group(cfg)
        try:
            return (group, *group.load(progress))
        except BaseException:
            group.close()
            raise
    return (group, *group.load(progress, cfg=cfg))


def _load(rank: Rank, cfg, progress: bool):
    # Ranks share the node's cores: without --threads each takes its share (more threads than cores
    # makes every rank wait for the slowest at each all-reduce).
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                           rank.world))))
    mc = MoEConfig.from_hf(cfg.model)
    rank.plan = plan(mc, Shard(rank.tp_rank, rank.tp))
    if rank.pp > 1:
        rank.layers, rank.moe = stage_layers(mc, rank.pp, rank.stage)
    return cfg.load(progress=progress and rank.driver, rank=rank)


def _engine(rank: Rank, cfg, model, store, kw: dict):
    eng = cfg.engine(model, store, **kw)
    eng.fail_fast = True                 # an error inside a step breaks the group: no rank goes on alone
    eng.scheduler.token_sync = lambda picks: rank.broadcast(picks, src=rank.source)
    # Pipeline stages cache different layers, so the same budget makes different block counts: every rank
    # takes the smallest, so admission and preemption decide the same everywhere.
    n = rank.min([model.kv.num_blocks])[0]
    if n != model.kv.num_blocks:
        model.init_kv(model.kv_bytes, max_seqs=eng.scheduler.max_active, num_blocks=n, snapshots=eng.prefix_snapshots)
        eng.kv = KVManager.for_cache(model.kv)          # the scheduler reads the engine's current manager
    # Prefix caching decides alike on every rank only where all keep per-sequence state or none does: a stage of
    # full-attention layers alone would reuse prefixes its stateful peers have no snapshot for.
    stateful = int(bool(model.kv.state_slots))
    lo, neg_hi = rank.min([stateful, -stateful])
    if lo != -neg_hi:
        eng.scheduler.prefix_caching = False
    if rank.pp > 1:
        leaders = [s * rank.tp for s in range(rank.pp)]
        eng.routing_sync = lambda mine: _merge_routing(rank.all_gather(mine), leaders)
    return eng


def _merge_routing(every: list, leaders: list) -> list:
    """Each stage's [(MoE layer, ids)] (from its first rank), stage after stage."""
    return [x for r in leaders for x in every[r]]


class GroupEngine:
    """Rank 0's engine, as the plain ``Engine`` is used (add_request, abort, forget, step_result, run, ...):
    each call that changes state is also queued for the other ranks and sent before the next step."""

    def __init__(self, eng, rank: Rank) -> None:
        self.eng, self.rank = eng, rank
        self._queue: list = []
        self._last_sync = time.monotonic()

    def __getattr__(self, name: str):
        return getattr(self.eng, name)

    def add_request(self, prompt: list, params=None, cache_salt: "str | None" = None) -> int:
        rid = self.eng.add_request(prompt, params, cache_salt)      # validated here first: a bad request never travels
        # the salt too: every rank schedules alike, prefix-cache hits included
        self._queue.append(("add", [int(t) for t in prompt], params, cache_salt))
        return rid

    def abort(self, rid: int) -> None:
        self.eng.abort(rid)
        self._queue.append(("abort", rid))

    def forget(self, rid: int):
        self._queue.append(("forget", rid))
        return self.eng.forget(rid)

    def _send(self, cmds: list) -> None:
        self.rank.broadcast(self._queue + cmds)
        self._queue = []
        self._last_sync = time.monotonic()

    def step_result(self):
        self._send([("step",)])
        return self.eng.step_result()

    def step(self) -> list:
        return self.step_result().outputs

    def run(self) -> dict:
        while self.eng.has_work():
            self.step()
        return self.eng.done

    def idle(self) -> None:
        """Between steps with nothing to run: keep the workers' wait short of the group timeout."""
        if time.monotonic() - self._last_sync >= IDLE_SYNC_S:
            self._send([])

    def gather(self, what: str) -> list:
        """Every rank's ``what`` (see ``rank_info``), rank 0 first."""
        self._send([("gather", what)])
        return self.rank.gather(rank_info(self.eng, what))

    def score(self, prompts: list):
        """Logits of each prompt's last token [len(prompts), vocab], by one forward of every rank
        (``Engine.score``; the last stage's, with pipeline stages)."""
        self._send([("score", [list(map(int, p)) for p in prompts])])
        return self.rank.broadcast(self.eng.score(prompts), src=self.rank.source)

    def summary(self) -> dict:
        """``Engine.summary``; with pipeline stages the store figures (hits, bytes, stall, computed) summed over
        the stages (each stage's first rank: the others hold the same experts' other slices)."""
        s = self.eng.summary()
        if self.rank.pp == 1:
            return s
        every = self.gather("summary")
        stages = [every[k * self.rank.tp] for k in range(self.rank.pp)]
        for key in ("hits", "bytes", "computed"):
            s[key] = {k: sum(x[key][k] for x in stages) for k in s[key]}
        s["stall_seconds"] = sum(x["stall_seconds"] for x in stages)
        need = sum(s["hits"].values())
        s["hit_rate_device"] = s["hits"]["device"] / need if need else None
        return s


def rank_info(eng, what: str):
    """What ``GroupEngine.gather`` collects from a rank: ``residency`` (the device tier's experts, as
    placement and the slots hold them), ``snapshot`` (the store's counters), ``layout`` (the rank's
    split and bytes)."""
    st = eng.store
    if what == "residency":
        return {"slots": sorted(st.dev.slot_of),
                "placement": sorted(k for pool in st.placement.unique_pools("device") for k in pool.resident)}
    if what == "snapshot":
        return st.snapshot()
    if what == "summary":
        return eng.summary()
    if what == "layout":
        p = eng.model.tp.plan if eng.model.tp is not None else None
        r = eng.model.tp
        return {"rank": r.rank if r is not None else 0, "stage": r.stage if r is not None else 0,
                "layers": [eng.model.layer_ids.start, eng.model.layer_ids.stop], "moe_layers": list(st.layers),
                "expert_slice_bytes": st.m.blob_bytes, "expert_bytes": st.full_m.blob_bytes,
                "kv_bytes_per_token": eng.model.kv_bytes_per_token(),
                "host_shared": st.segment is not None, "host_pinned": bool(st.segment and st.segment.pinned),
                "host_bytes": st.capacity_bytes()["host"],
                **(p.summary() if p is not None else {})}
    raise ValueError(f"unknown rank info {what!r}")


class Worker:
    """Ranks 1..N-1: apply rank 0's commands to this rank's engine until told to stop."""

    def __init__(self, rank: Rank, cfg: dict) -> None:
        self.rank, self.cfg = rank, RuntimeConfig(**cfg)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.model = self.store = self.eng = None

    def run(self) -> None:
        try:
            while True:
                cmds = self.rank.broadcast()
                if isinstance(cmds, tuple):          # set-up: ("load", config, progress) / ("engine", kwargs)
                    if cmds[0] == "load":
                        if self.store is not None:
                            self.store.close()
                        self.model = self.store = self.eng = None
                        self.cfg = RuntimeConfig(**cmds[1])
                        self.model, self.store = _load(self.rank, self.cfg, False)
                    elif cmds[0] == "engine":
                        self.eng = _engine(self.rank, self.cfg, self.model, self.store, cmds[1])
                    continue
                for c in cmds:
                    if c[0] == "stop":
                        return
                    self.apply(c)
        finally:
            if self.store is not None:
                self.store.close()

    def apply(self, c: tuple) -> None:
        eng = self.eng
        kind = c[0]
        if kind == "add":
            eng.add_request(c[1], c[2], c[3])
        elif kind == "abort":
            eng.abort(c[1])
        elif kind == "forget":
            eng.forget(c[1])
        elif kind == "step":
            eng.step_result()
        elif kind == "gather":
            self.rank.gather(rank_info(eng, c[1]))
        elif kind == "score":
            self.rank.broadcast(eng.score(c[1]), src=self.rank.source)
        else:
            raise ValueError(f"unknown command {kind!r} from rank 0")
