"""``streamforge up``: brokers + feeder + N generators + buffer(s) + trainer as child processes of one command.

Contract: starts the embedded brokers unless the config names external ones (``kafka.bootstrap`` and ``nats.url``):
their data in ``<run_dir>/brokers``; with them it archives the run's topics in ``<run_dir>/log`` as they are
written (``brokers.archive``, ``streamforge/logarchive.py``: restored first when the directory has one), so the
run's log outlives ``up``; it creates the run's topics, prepares the model when ``model.path`` is empty (converts ``model.source`` once into its
cache dir, or builds the tiny model into ``<run_dir>/model``), then starts every role with
``streamforge run <role>`` (each logs to ``<run_dir>/logs/<name>.log``): the service replicas of the configured
environment and reward service (``up.envs``, ``up.rewards``; ``streamforge/replicas.py``) first, the generators
once those have registered, and the evaluator with ``up.evaluators: 1`` (``producers/evaluator.py``: it reads
the trainer's exports, so the trainer never waits on it). It waits for the trainer to finish
(``trainer.max_steps`` or ``trainer.reward_target``: it exits 0 and writes ``trainer/done.json``; a trainer that
exits without it did not finish, a failure), then drains the other roles (SIGTERM, SIGKILL after
``up.drain_timeout_s``), runs the audit, plots ``reward.png`` and exits 0. If a child dies it reports which and
why (exit code and the tail of its log) and stops the rest with exit code 1, or restarts it when
``up.restart`` is set. A wall budget (``up.max_wall_s``) that runs out stops the run with exit code 1: the run
did not finish. First SIGINT/SIGTERM: graceful stop of everything; second: kill.

Each role runs in a process group of its own. A role's children (vLLM's engine core and workers, torchrun's
ranks) stay in that group even when the role's main process dies and they are re-parented: before ``up``
restarts a role, and when it exits, it kills the role's whole group and waits until nothing of it is left (and if
``up`` itself is killed, each role gets SIGTERM from the kernel: a Linux death signal), so a
crashed generator's 2.5 GiB engine never outlives it.

Several generators on one CPU host: vLLM's CPU engine binds its OpenMP threads to the same cores in every process
(core 0 on a 2-core machine), so N engines would share one core while the others idle. Unless
``VLLM_CPU_OMP_THREADS_BIND`` is already set, ``up`` gives each generator its own slice of the cores
(``cpu_binds``); GPU builds of vLLM ignore the variable. From 4 cores up it also keeps the trainer off the engines'
cores (``cpu_plan``: ``up.cpu_partition``, ``up.trainer_cpu_share``), unless the trainer's or the generators' own
``cpus`` or that variable already place them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamforge.brokers import death_signal
from streamforge.config import dump_config
from streamforge.cpumeter import CpuMeter

log = logging.getLogger("streamforge.up")


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.time)
    env: dict[str, str] = field(default_factory=dict)  # added to (or replacing) this process's environment

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:  # the child holds its own copy of the descriptor
            # the role gets SIGTERM (it drains and stops its own children) if up itself dies without stopping it
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, **self.env} if self.env else None,
                                         preexec_fn=death_signal(signal.SIGTERM))  # noqa: PLW1509 - prctl only
        self.started_at = time.time()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """SIGTERM goes to the role process alone (it drains and stops its own children, e.g. vLLM's engine);
        SIGKILL goes to its whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGKILL:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)

    def reap(self, timeout_s: float = 10.0) -> bool:
        """Kill what is left of the role's process group (its main process has exited, or is killed too) and
        wait until the group is empty; True when it is."""
        if self.proc is None:
            return True
        pgid = self.proc.pid  # start_new_session: the role is its group's leader
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break  # nothing of the group is left
            except PermissionError:  # pragma: no cover - a pgid reused by someone else's process
                break
            self.proc.poll()  # collect the leader if it is a zombie of ours
            if time.monotonic() > deadline:
                log.warning("%s: process group %d still has members after SIGKILL", self.name, pgid)
                return False
            time.sleep(0.05)
        self.proc.poll()
        return True

    def log_tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the role's log, after the line that says why it stopped (a role's crash prints
        ``streamforge: <why>``) when that is further up: exit-time noise (library leak reports) can fill a tail."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        why = [line for line in lines if line.startswith("streamforge: ")]
        tail = lines[-n:]
        if why and why[-1] not in tail:
            tail = [why[-1], "..."] + tail
        return "\n".join(tail)


def cpu_binds(generators: int, *, cpus: int | Sequence[int] | None = None,
              environ: Any = None) -> list[str | None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each of ``generators`` generators on this host (see the module docstring):
    ``None`` (vLLM's own choice) for a single generator or when the user set the variable; otherwise disjoint
    slices of the cores this process may run on (``"0-3"``, ``"4-7"``), or one core each, shared round-robin,
    when cores are fewer. ``cpus``: the core ids (or a count of ids from 0); default: this process's affinity."""
    environ = os.environ if environ is None else environ
    if generators <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return [None] * max(generators, 0)
    ids = sorted(os.sched_getaffinity(0)) if cpus is None else list(range(cpus) if isinstance(cpus, int) else cpus)
    if len(ids) < generators:
        return [str(ids[i % len(ids)]) for i in range(generators)]
    width = len(ids) // generators
    return [_id_list(ids[i * width:(i + 1) * width]) for i in range(generators)]


# from this many cores up, `up` gives the trainer and the engines disjoint cores on a CPU host (``cpu_plan``): below
# it vLLM's own placement stays (on 2 cores its worker on core 0, the trainer's two threads on both, measured the
# fastest: the split trainer-on-one-core stepped no faster, bench/RESULTS.md 2026-12-05)
PARTITION_MIN_CORES = 4


def cpu_plan(config: Any, *, cpus: int | Sequence[int] | None = None, environ: Any = None,
             cuda: bool | None = None) -> tuple[str | None, list[str | None]]:
    """(``trainer.cpus`` for the trainer or None, ``VLLM_CPU_OMP_THREADS_BIND`` of each engine: the generators',
    then the evaluator's). On a CPU host of at least ``PARTITION_MIN_CORES`` cores with ``up.cpu_partition``
    (default true) and none of ``trainer.cpus``, ``generator.cpus`` or ``VLLM_CPU_OMP_THREADS_BIND`` set, the
    trainer (one rank) takes the last ``up.trainer_cpu_share`` of the cores and the engines split the first ones:
    vLLM's own choice would put its OpenMP threads on every core but one, and the trainer's on every core, two
    thread pools that each wait at their barriers for a thread the other pool holds off its core (on 2 cores, a
    step beside a two-thread matmul loop took 7-19 s against 2.0 s alone: bench/RESULTS.md). Otherwise
    ``(None, cpu_binds(...))``."""
    environ = os.environ if environ is None else environ
    engines = config.up.generators + config.up.evaluators
    ids = sorted(os.sched_getaffinity(0)) if cpus is None else list(range(cpus) if isinstance(cpus, int) else cpus)
    cuda = cuda_host(environ) if cuda is None else cuda
    if (not config.up.cpu_partition or cuda or engines < 1 or len(ids) < PARTITION_MIN_CORES
            or config.trainer.cpus or config.generator.cpus or config.trainer.world_size > 1
            or "VLLM_CPU_OMP_THREADS_BIND" in environ):
        return None, cpu_binds(engines, cpus=ids, environ=environ)
    n = min(max(1, round(len(ids) * config.up.trainer_cpu_share)), len(ids) - 1)
    rest = ids[:len(ids) - n]
    if engines == 1:
        return _id_list(ids[-n:]), [_id_list(rest)]
    return _id_list(ids[-n:]), cpu_binds(engines, cpus=rest, environ=environ)


def cuda_host(environ: Any = None) -> bool:
    """Whether this host has an NVIDIA GPU the roles may use (a device node, not hidden by ``CUDA_VISIBLE_DEVICES``),
    read without importing torch."""
    environ = os.environ if environ is None else environ
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def _id_list(ids: list[int]) -> str:
    """vLLM's CPU id list syntax: ``"4-7"`` for a contiguous run, else ``"1,3,5"``."""
    if ids == list(range(ids[0], ids[-1] + 1)):
        return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def child_overrides(config: Any, *, kafka: str, nats: str, model_path: str) -> list[str]:
    out = [f"--run.run_dir={config.run_dir}", f"--kafka.bootstrap={kafka}", f"--nats.url={nats}"]
    if model_path:
        out.append(f"--model.path={model_path}")
    return out


async def _stop_children(children: list[Child], timeout_s: float) -> None:
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(c.poll() is None for c in children):
        await asyncio.sleep(0.2)
    for c in children:
        if c.poll() is None:
            log.warning("%s did not drain within %.0f s; killing it", c.name, timeout_s)
            c.signal(signal.SIGKILL)
    for c in children:  # whatever each role left behind (an engine core re-parented after a crash)
        await asyncio.to_thread(c.reap)


class ProgressView:
    """The live progress of ``up`` (``streamforge/progress.py``): a rich table redrawn in place on a terminal
    (``up.live: auto|table``), else one line per new trainer step (``lines``, and whenever stdout is a pipe)."""

    def __init__(self, config: Any) -> None:
        from streamforge.progress import Lag

        self.run_dir = config.run_dir
        mode = config.up.live
        self.table = mode == "table" or (mode == "auto" and sys.stdout.isatty())
        self.lag = Lag(config, config.up.lag_every_s) if config.up.lag_every_s > 0 else None
        self.live: Any = None
        self.step = 0

    def start(self) -> None:
        if self.lag is not None:
            self.lag.start()
        if self.table:
            from rich.live import Live

            from streamforge.progress import Snapshot, progress_table

            self.live = Live(progress_table(Snapshot()), refresh_per_second=2, transient=False)
            self.live.start()

    def refresh(self) -> None:
        from streamforge.progress import progress_line, progress_table, read_snapshot

        snap = read_snapshot(self.run_dir, self.lag.value if self.lag is not None else None)
        if self.live is not None:
            self.live.update(progress_table(snap))
        elif snap.trainer is not None and snap.step != self.step:
            self.step = snap.step
            print(progress_line(snap), flush=True)

    async def stop(self) -> None:
        if self.lag is not None:
            await self.lag.stop()
        if self.live is not None:
            self.live.stop()
            self.live = None


async def _up(config: Any, config_path: str | None, overrides: list[str]) -> int:
    from runtime.malloc import allocator_env
    from streamforge.brokers import EmbeddedBrokers
    from topics.admin import ensure_topics

    alloc_env = allocator_env(config.up.allocator)  # up.allocator: a ConfigError before anything starts
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    embedded = None
    if config.kafka.bootstrap and config.nats.url:
        kafka, nats_url = config.kafka.bootstrap, config.nats.url
    else:
        data_dir = Path(config.brokers.data_dir) if config.brokers.data_dir else run_dir / "brokers"
        embedded = EmbeddedBrokers(data_dir, durable=config.brokers.durable, kafka_port=config.brokers.kafka_port,
                                   nats_port=config.brokers.nats_port, host=config.brokers.host)
        await embedded.start()
        kafka, nats_url = embedded.kafka_bootstrap, embedded.nats_url
    print(f"KAFKA_BOOTSTRAP={kafka}\nNATS_URL={nats_url}\nRUN_DIR={run_dir}", flush=True)
    children: list[Child] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            print("stopping (again to kill)", flush=True)
            stop.set()
        else:
            for c in children:
                c.signal(signal.SIGKILL)
            if embedded is not None:
                embedded.terminate_nowait()
            os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    code = 0
    view: ProgressView | None = None
    meter: CpuMeter | None = None
    archiver = None
    try:
        config.kafka.bootstrap, config.nats.url = kafka, nats_url
        if embedded is not None and config.brokers.archive and not config.brokers.durable:
            from streamforge.logarchive import start_archive

            archiver = await start_archive(config.kafka, config.names, config.topics, run_dir)
        await ensure_topics(config.kafka, config.names, config.topics)
        model_path = config.model.path
        if not model_path and config.model.source:
            from models.hf_models import default_cache_dir, ensure_source_model

            cache = config.model.cache_dir or str(default_cache_dir())
            print(f"model {config.model.source}: {cache}/{config.model.source} (converted on first use)", flush=True)
            model_path = str(await asyncio.to_thread(ensure_source_model, config.model.source, cache))
        elif not model_path:
            from models.tiny_model import build_tiny_model

            model_path = str(run_dir / "model")
            if not (Path(model_path) / "config.json").exists():  # in a thread: Ctrl-C is heard meanwhile
                await asyncio.to_thread(build_tiny_model, model_path, seed=config.run.seed)
                if config.model.warmstart_task:
                    from models.warmstart import warm_start

                    result = await asyncio.to_thread(warm_start, model_path, config.model.warmstart_task,
                                                     seed=config.run.seed,
                                                     target_accuracy=config.model.warmstart_accuracy)
                    print(f"warm start: {result['steps']:.0f} supervised steps to greedy accuracy "
                          f"{result['accuracy']:.2f} on {config.model.warmstart_task}", flush=True)
        if stop.is_set():  # stopped while preparing: start no role
            return 130
        common = overrides + child_overrides(config, kafka=kafka, nats=nats_url, model_path=model_path)
        base = [sys.executable, "-m", "streamforge", "run"]
        cfg_args = ["--config", config_path] if config_path else []

        def child(name: str, role: str, extra: list[str] = ()) -> Child:  # type: ignore[assignment]
            return Child(name, role, [*base, role, *cfg_args, *common, *extra], run_dir / "logs" / f"{name}.log")

        from streamforge.replicas import replica_children, wait_registered
        from streamforge.roles import RoleNotAvailable, role_class

        missing = []
        for role in ("feeder", "generator", "buffer", "trainer"):
            try:
                role_class(role)
            except RoleNotAvailable as exc:
                missing.append(str(exc))
        if missing:
            print("brokers are up and topics created, but not every role exists yet:\n  " + "\n  ".join(missing),
                  flush=True)
            return 2
        trainer = child("trainer", "trainer")
        if config.trainer.world_size > 1:  # ranks are started by torchrun; the trainer checks the world size
            trainer.argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={config.trainer.world_size}", "-m", "streamforge", "run", "trainer",
                            *cfg_args, *common]
        children = [trainer, child("feeder", "feeder")]
        children += [child(f"buffer-{i}", "buffer", [f"--buffer.buffer_id=buffer-{i}"])
                     for i in range(config.up.buffers)]
        replicas = replica_children(config, child)  # environment and reward replicas (streamforge/replicas.py)
        children += replicas
        trainer_cpus, binds = cpu_plan(config)  # an evaluator's engine gets cores too
        if trainer_cpus is not None:
            trainer.argv.append(f"--trainer.cpus={trainer_cpus}")
            log.info("cores: trainer %s, engines %s", trainer_cpus, ", ".join(b or "vLLM's choice" for b in binds))
        for i, bind in enumerate(binds[:config.up.generators]):
            gen = child(f"generator-{i}", "generator", [f"--generator.generator_id=generator-{i}"])
            if bind is not None:
                gen.env["VLLM_CPU_OMP_THREADS_BIND"] = bind
            children.append(gen)
        for bind in binds[config.up.generators:]:  # up.evaluators: producers/evaluator.py, never waited on
            evaluator = child("evaluator", "evaluator")
            if bind is not None:
                evaluator.env["VLLM_CPU_OMP_THREADS_BIND"] = bind
            children.append(evaluator)
        for c in children:
            c.env.update(alloc_env)
        for c in children:
            if c.role != "generator":  # generators start once the service replicas are registered
                c.start()
        why = await wait_registered(config, replicas, stop)
        if why:
            print(f"service replicas: {why}", file=sys.stderr, flush=True)
            for c in replicas:
                if c.poll() is not None:
                    print(f"last lines of {c.log_path}:\n{c.log_tail()}", file=sys.stderr, flush=True)
            return 130 if stop.is_set() else 1
        for c in children:
            if c.role == "generator":
                c.start()
        print(f"started {', '.join(c.name for c in children)}; logs in {run_dir / 'logs'}", flush=True)
        view = ProgressView(config)
        view.start()
        meter = CpuMeter(own="up")
        # the embedded brokers (each in a session of its own) count as roles too: on a CPU host they share its cores
        broker_groups = {f"broker-{name}": pgid for name, pgid in
                         (embedded.process_groups() if embedded is not None else {}).items()}
        waiter = asyncio.ensure_future(stop.wait())
        started = time.monotonic()
        while not stop.is_set():
            if config.up.max_wall_s and time.monotonic() - started > config.up.max_wall_s:
                print(f"wall-clock budget of {config.up.max_wall_s:.0f} s reached before the trainer finished; "
                      "stopping (exit code 1)", file=sys.stderr, flush=True)
                code = 1
                break
            await asyncio.wait([waiter], timeout=1.0)
            view.refresh()
            meter.sample({c.name: c.proc.pid for c in children if c.proc is not None} | broker_groups)
            if archiver is not None and archiver.task.done():  # the run's log is no longer kept: stop
                print(f"the log archive stopped: {archiver.task.exception()!r}", file=sys.stderr, flush=True)
                code = 1
                break
            rc = trainer.poll()
            done = run_dir / "trainer" / "done.json"
            if rc == 0 and done.exists():
                print(f"trainer finished: {orjson.loads(done.read_bytes()).get('reason', '')}", flush=True)
                break
            if rc == 0:  # it stopped without reaching max_steps or its reward target (a SIGTERM from elsewhere)
                print("trainer exited without finishing the run (no trainer/done.json)", file=sys.stderr, flush=True)
            failed = [c for c in children if c.poll() is not None and (c is trainer or c.poll() != 0)]
            failed += [c for c in children if c.poll() == 0 and c.role not in ("trainer", "feeder")]
            if failed:
                if config.up.restart:
                    for c in failed:
                        print(f"{c.name} exited with code {c.poll()}; restarting it", flush=True)
                        await asyncio.to_thread(c.reap)
                        c.restarts += 1
                        c.start()
                    continue
                for c in failed:
                    print(f"{c.name} exited with code {c.poll()}; last lines of {c.log_path}:\n{c.log_tail()}",
                          file=sys.stderr, flush=True)
                code = 1
                break
        waiter.cancel()
    finally:
        if view is not None:
            await view.stop()
        if meter is not None:
            meter.sample({c.name: c.proc.pid for c in children if c.proc is not None} | broker_groups)
            meter.write(run_dir / "cpu.json")
        await _stop_children(children, config.up.drain_timeout_s)
        if archiver is not None:
            await archiver.close()
        if children:  # also after a failure or a spent budget: what was trained is audited
            await _finish(config)
        if embedded is not None:
            embedded.stop()
    print(f"run directory: {run_dir}  (open reward.png, metrics.jsonl, traces.jsonl, audit.json)", flush=True)
    if archiver is not None or (embedded is not None and embedded.durable):  # the log stays in the run directory
        print(f"its log is kept: streamforge replay|provenance|audit --run-dir {run_dir}", flush=True)
    return code


async def _finish(config: Any) -> None:
    from streamforge.plots import plot_run

    try:
        from streamforge.audit import run_audit

        result = await run_audit(config)
        (config.run_dir / "audit.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        print("audit: " + orjson.dumps({k: result.get(k) for k in ("produced", "batched", "trained", "lost",
                                                                   "trained_twice")}).decode(), flush=True)
    except ImportError:
        print("audit not available yet", flush=True)
    plot_run(config.run_dir)


def run_up(config: Any, *, config_path: str | None, overrides: list[str]) -> int:
    from runtime.lifecycle import run_on_uvloop

    return run_on_uvloop(_up(config, config_path, overrides))
