"""A real offset hole in a partition of the embedded broker: a record batch whose records skip offset deltas.

A Kafka record batch gives each record an offset delta from the batch's base offset, and its header the last
delta; compaction on a real Kafka leaves batches whose deltas skip the removed records. Tansu stores a produced
batch as it is and reserves ``last_offset_delta + 1`` offsets for it, so a batch with records at deltas 0 and 3
puts records at base and base + 3 and nothing at base + 1 and base + 2: offsets a consumer never receives while it
receives those around them, for ever (the transient hole Tansu's produce race leaves heals; this one does not).
"""

from __future__ import annotations

from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from topics.kafka import TopicPartition


async def produce_with_holes(bootstrap: str, topic: str, partition: int,
                             records: list[tuple[int, bytes | None, bytes]]) -> int:
    """Produce one batch of ``records`` (offset delta, key, value) to ``topic``/``partition`` with one raw
    ProduceRequest (acks all); returns the batch's base offset from the broker's answer."""
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=16 * 1024 * 1024)
    for delta, key, value in sorted(records, key=lambda r: r[0]):
        builder.append(delta, timestamp=None, key=key, value=value, headers=[])
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        node = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        resp = await client.send(node, ProduceRequest(None, -1, 30_000, [(topic, [(partition, bytes(builder.build()))])]))
        for _topic, parts in resp.topics:
            for part, error_code, base_offset, *_ in parts:
                if part == partition:
                    if error_code:
                        raise RuntimeError(f"produce to {topic}/{partition} refused: error code {error_code}")
                    return base_offset
        raise RuntimeError(f"no answer for {topic}/{partition}")
    finally:
        await client.close()
