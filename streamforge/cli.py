"""The ``streamforge`` command line. Thin: each command maps straight onto the config and a library call.

Every command that takes ``--config`` also takes ``--section.key=value`` overrides after its arguments and reads
``STREAMFORGE_*`` environment variables (see ``streamforge/config.py``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click
import orjson

from topics.errors import AuthenticationFailed, BrokerUnavailable, ConfigError

OVERRIDES = {"ignore_unknown_options": True, "allow_extra_args": True}


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("aiokafka", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(config: str | None, overrides: tuple[str, ...], extra: list[str] = ()) -> Any:  # type: ignore[assignment]
    from streamforge.config import load_config

    try:
        return load_config(config, [*overrides, *extra])
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _run_async(coro: Any) -> Any:
    from runtime.lifecycle import run_on_uvloop

    try:
        return run_on_uvloop(coro)
    except (BrokerUnavailable, AuthenticationFailed) as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """streamforge: asynchronous RL post-training for LLMs over Kafka and NATS."""


@main.command()
@click.option("--durable", is_flag=True, help="Tansu over a local SeaweedFS (survives restarts).")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, help="Broker data (default: a temp dir).")
@click.option("--kafka-port", type=int, default=0, help="0 = a free port.")
@click.option("--nats-port", type=int, default=0, help="0 = a free port.")
@click.option("--host", default="127.0.0.1")
def brokers(durable: bool, data_dir: Path | None, kafka_port: int, nats_port: int, host: str) -> None:
    """Start the embedded Kafka-protocol (Tansu) and NATS brokers; run until SIGINT/SIGTERM."""
    import tempfile

    from streamforge.brokers import EmbeddedBrokers

    setup_logging()
    data = data_dir or Path(tempfile.mkdtemp(prefix="streamforge-brokers-"))

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        b = EmbeddedBrokers(data, durable=durable, kafka_port=kafka_port, nats_port=nats_port, host=host)
        await b.start()
        try:
            print(f"KAFKA_BOOTSTRAP={b.kafka_bootstrap}", flush=True)
            print(f"NATS_URL={b.nats_url}", flush=True)
            print(f"DATA_DIR={data}", flush=True)
            waiter = asyncio.ensure_future(stop.wait())
            while not stop.is_set():
                await asyncio.wait([waiter], timeout=1.0)
                dead = [n for n, ok in b.alive().items() if not ok]
                if dead:
                    raise click.ClickException(f"broker process(es) exited: {', '.join(dead)}")
        finally:
            b.stop()

    _run_async(serve())


def metrics_name(role: str, config: Any) -> str:
    """The metrics label (and ``metrics-<label>.jsonl``) of a role process: its id where several may run."""
    ident = {"generator": config.generator.generator_id, "buffer": config.buffer.buffer_id,
             "env": config.env.replica_id, "reward": config.reward.replica_id}.get(role, "")
    if not ident:
        return role
    return ident if ident.startswith(role) else f"{role}-{ident}"


@main.command(context_settings=OVERRIDES)
@click.argument("role")
@click.option("--config", "config_path", type=click.Path(), default=None, help="Run config YAML.")
@click.pass_context
def run(ctx: click.Context, role: str, config_path: str | None) -> None:
    """Run one role process: feeder, generator, buffer, trainer, env (an environment replica), reward (a reward
    service replica) or evaluator (scores the trainer's exported versions on held-out prompts: eval.jsonl).

    Configure it with --section.key=value overrides after the role; `streamforge config --explain` lists every
    key with its type, default and meaning."""
    from runtime.lifecycle import run_service
    from runtime.metrics import close_metrics, configure_metrics
    from runtime.telemetry import setup_tracing, shutdown_tracing
    from streamforge.roles import RoleNotAvailable, build_role, prepare_process

    config = _load(config_path, tuple(ctx.args))
    setup_logging(config.telemetry.log_level)
    try:
        prepare_process(role, config)  # before the role's module imports torch
        service = build_role(role, config)
    except (RoleNotAvailable, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    config.run_dir.mkdir(parents=True, exist_ok=True)
    setup_tracing(role, config.run_dir, exporter=config.telemetry.traces,
                  otlp_endpoint=config.telemetry.otlp_endpoint)
    configure_metrics(metrics_name(role, config), config.run_dir, config.telemetry.metrics,
                      wandb_project=config.telemetry.wandb_project, run_config=config.to_dict())
    try:
        code = run_service(service)
    finally:
        close_metrics()
        shutdown_tracing()
    sys.exit(code)


@main.command(context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None)
@click.option("--run-dir", type=click.Path(path_type=Path), default=None, help="Overrides run.run_dir.")
@click.pass_context
def up(ctx: click.Context, config_path: str | None, run_dir: Path | None) -> None:
    """Start brokers (unless external ones are configured) and every role; stop when training is done."""
    from streamforge.up import run_up

    extra = [f"--run.run_dir={run_dir}"] if run_dir else []
    config = _load(config_path, tuple(ctx.args), extra)
    setup_logging(config.telemetry.log_level)
    try:
        code = run_up(config, config_path=config_path, overrides=list(ctx.args) + extra)
    except ConfigError as exc:  # found at start-up (up.allocator), before anything started
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


@main.command("config", context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None, help="Run config YAML.")
@click.option("--explain", is_flag=True, help="Every key with its type, default, value and the comment in the code.")
@click.option("--section", default="", help="Only this section (with --explain), e.g. staleness or buffer.")
@click.pass_context
def config_command(ctx: click.Context, config_path: str | None, explain: bool, section: str) -> None:
    """Print the resolved run config (defaults < YAML < STREAMFORGE_* < overrides), derived values included."""
    from streamforge.config import dump_config
    from streamforge.explain import explain_text

    config = _load(config_path, tuple(ctx.args))
    if section and section not in config.to_dict():
        raise click.ClickException(f"no config section {section!r}; sections: {', '.join(config.to_dict())}")
    click.echo(explain_text(config, section) if explain else dump_config(config), nl=False)


@main.command("nats-permissions", context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None, help="Run config YAML.")
@click.pass_context
def nats_permissions(ctx: click.Context, config_path: str | None) -> None:
    """Print nats-server's `authorization` block for the run: one user per role, each allowed only its subjects."""
    from streamforge.permissions import config_authorization

    config = _load(config_path, tuple(ctx.args))
    click.echo(config_authorization(config), nl=False)


@main.group()
def topics() -> None:
    """Create or describe the run's topics."""


@topics.command("create", context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None)
@click.pass_context
def topics_create(ctx: click.Context, config_path: str | None) -> None:
    """Create every topic of the run (configured partitions; existing ones are kept)."""
    from topics.admin import ensure_topics

    config = _load(config_path, tuple(ctx.args))
    created = _run_async(ensure_topics(config.kafka, config.names, config.topics))
    for name in config.names.topics():
        click.echo(f"{name}\t{'created' if name in created else 'exists'}")


@topics.command("describe", context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None)
@click.pass_context
def topics_describe(ctx: click.Context, config_path: str | None) -> None:
    """Partitions, records and configs (retention) per topic of the run."""
    from topics.admin import describe_topics, highwaters, topic_configs

    config = _load(config_path, tuple(ctx.args))

    async def go() -> dict[str, Any]:
        out = await describe_topics(config.kafka, config.names.topics())
        for name, row in out.items():
            if row.get("partitions"):
                row["records"] = sum((await highwaters(config.kafka, name)).values())
                row["configs"] = await topic_configs(config.kafka, name)
        return out

    click.echo(orjson.dumps(_run_async(go()), option=orjson.OPT_INDENT_2).decode())


@main.command(context_settings=OVERRIDES)
@click.argument("topic")
@click.option("--config", "config_path", type=click.Path(), default=None)
@click.option("--follow", "-f", is_flag=True, help="Keep waiting for new messages.")
@click.option("--max", "max_messages", type=int, default=0, help="Stop after N messages (0 = all).")
@click.option("--full", is_flag=True, help="Print whole tensors instead of a summary.")
@click.pass_context
def tail(ctx: click.Context, topic: str, config_path: str | None, follow: bool, max_messages: int,
         full: bool) -> None:
    """Decode and print the messages of TOPIC (a short name like `episodes`, or a full topic name)."""
    from streamforge.tail import tail as tail_topic

    config = _load(config_path, tuple(ctx.args))
    short = {t.split(".", 1)[1]: t for t in config.names.topics()}
    name = short.get(topic, topic)
    _run_async(tail_topic(config.kafka, name, follow=follow, max_messages=max_messages, full=full))


@main.command(context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None)
@click.option("--interval", type=float, default=1.0, help="Seconds between the two throughput samples.")
@click.pass_context
def status(ctx: click.Context, config_path: str | None, interval: float) -> None:
    """Policy versions (latest, per generator), lag per topic, throughput."""
    from streamforge.status import status as get_status

    config = _load(config_path, tuple(ctx.args))
    click.echo(orjson.dumps(_run_async(get_status(config, interval_s=interval)), option=orjson.OPT_INDENT_2).decode())


def _reopened(run_dir: Path, config_path: str | None, overrides: tuple[str, ...], work: Any) -> Any:
    """Run ``work(config)`` (a coroutine function) on a finished run's log, reopened (``streamforge/runlog.py``);
    its typed errors become one clear message."""
    from streamforge.replay import BatchesGone
    from streamforge.runlog import RecordGone, RunLogUnavailable, reopen, run_config

    async def go() -> Any:
        async with reopen(run_config(run_dir, config_path=config_path, overrides=overrides)) as config:
            return await work(config)

    try:
        return _run_async(go())
    except (RunLogUnavailable, BatchesGone, RecordGone, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None


RUN_DIR = click.option("--run-dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
                       help="A run's directory: its config.yaml, and its log reopened (the embedded broker started "
                            "again on it when none runs).")


@main.command(context_settings=OVERRIDES)
@click.option("--config", "config_path", type=click.Path(), default=None)
@RUN_DIR
@click.pass_context
def audit(ctx: click.Context, config_path: str | None, run_dir: Path | None) -> None:
    """Reconcile produced, batched, trained and dropped episodes, and the prompts the generators consumed; writes
    <run_dir>/audit.json and exits 1 when an episode or a prompt was lost or an episode trained twice."""
    try:
        from streamforge.audit import run_audit
    except ImportError as exc:
        raise click.ClickException(f"the audit is not built yet ({exc})") from None
    if run_dir is not None:
        result = _reopened(run_dir, config_path, tuple(ctx.args), run_audit)
    else:
        config = _load(config_path, tuple(ctx.args))
        result = _run_async(run_audit(config))
        run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    data = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    (run_dir / "audit.json").write_bytes(data)
    click.echo(data.decode())
    if result.get("lost") or result.get("trained_twice"):
        sys.exit(1)


@main.command(context_settings=OVERRIDES)
@RUN_DIR
@click.option("--steps", type=int, default=0, help="Replay the first N steps of the ledger (0 = all).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Default: <run-dir>/replay[-LOSS].")
@click.option("--loss", default="", help="Another loss on the same batches (an off-policy comparison).")
@click.option("--config", "config_path", type=click.Path(), default=None, help="For a run without config.yaml.")
@click.pass_context
def replay(ctx: click.Context, run_dir: Path | None, steps: int, out: Path | None, loss: str,
           config_path: str | None) -> None:
    """Re-train the run's batches from its initial model and compare each step's loss and grad norm.

    Last line: {"replay", "steps", "max_loss_diff", "max_grad_norm_diff", "identical"}; exit code 1 when not
    identical (always compared, also with --loss)."""
    from streamforge.replay import replay as replay_run

    if run_dir is None:
        raise click.UsageError("--run-dir is required")
    setup_logging("WARNING")

    def progress(row: dict[str, Any]) -> None:
        if row["step"] % 10 == 0:
            click.echo(f"step {row['step']}: loss {row['loss']:.6g} (run {row['orig_loss']}), grad_norm "
                       f"{row['grad_norm']:.6g} (run {row['orig_grad_norm']})", err=True)

    result = _reopened(run_dir, config_path, tuple(ctx.args),
                       lambda config: replay_run(config, steps=steps, out=out, loss=loss, on_step=progress))
    click.echo(orjson.dumps(result).decode())
    if not result["identical"] and not loss:
        sys.exit(1)


@main.command(context_settings=OVERRIDES)
@RUN_DIR
@click.argument("version", type=int, required=False)
@click.option("--episode", "episode_id", default="", help="The reverse: which batch, step and version trained it.")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON object (the last line).")
@click.option("--config", "config_path", type=click.Path(), default=None, help="For a run without config.yaml.")
@click.pass_context
def provenance(ctx: click.Context, run_dir: Path | None, version: int | None, episode_id: str, as_json: bool,
               config_path: str | None) -> None:
    """A policy VERSION's steps, batches, episodes (with their episodes-topic offsets), prompts and adopters."""
    from streamforge.provenance import episode_provenance, render, version_provenance

    if run_dir is None:
        raise click.UsageError("--run-dir is required")
    if (version is None) == (not episode_id):
        raise click.UsageError("give a VERSION or --episode EPISODE_ID")
    setup_logging("WARNING")
    if episode_id:
        result = _reopened(run_dir, config_path, tuple(ctx.args), lambda c: episode_provenance(c, episode_id))
    else:
        result = _reopened(run_dir, config_path, tuple(ctx.args), lambda c: version_provenance(c, version))
    click.echo(render(result))
    if as_json:
        click.echo(orjson.dumps(result).decode())


@main.command()
@click.option("--run-dir", type=click.Path(path_type=Path, exists=True), required=True)
@click.argument("episode_id")
def trace(run_dir: Path, episode_id: str) -> None:
    """Print the path of one episode through the system as a tree with timings."""
    from streamforge.traceview import render_episode_trace

    text = render_episode_trace(run_dir / "traces.jsonl", episode_id)
    if text is None:
        raise click.ClickException(f"no span mentions episode {episode_id} in {run_dir / 'traces.jsonl'}")
    click.echo(text)


if __name__ == "__main__":  # pragma: no cover
    main()
