"""Run inside the brokers host's namespace by ``tests/helpers/hostrun.py``: Tansu on one address and nats-server on
another of the same host (so that a peer can lose NATS alone, by a route), both through ``EmbeddedBrokers``.
Prints ``READY`` once both answer, then serves until SIGTERM/SIGINT.

    python tests/helpers/netns_brokers.py DATA_DIR KAFKA_IP KAFKA_PORT NATS_IP NATS_PORT
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streamforge.brokers import EmbeddedBrokers


async def serve(data: Path, kafka_ip: str, kafka_port: int, nats_ip: str, nats_port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    kafka = EmbeddedBrokers(data / "kafka", host=kafka_ip, kafka_port=kafka_port, nats_port=1)
    nats = EmbeddedBrokers(data / "nats", host=nats_ip, kafka_port=1, nats_port=nats_port)
    try:
        await asyncio.gather(kafka.start_kafka(), nats.start_nats())
        print("READY", flush=True)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                dead = [n for b in (kafka, nats) for n, ok in b.alive().items() if not ok]
                if dead:
                    raise SystemExit(f"broker process(es) exited: {dead}") from None
    finally:
        kafka.stop()
        nats.stop()


if __name__ == "__main__":
    d, kip, kport, nip, nport = sys.argv[1:6]
    asyncio.run(serve(Path(d), kip, int(kport), nip, int(nport)))
