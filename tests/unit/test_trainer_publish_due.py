"""When the trainer publishes a version: every ``publish_every`` steps, and with ``publish_busy: skip`` not while
the previous round still waits for generators (plain fakes: no broker, no model)."""

from __future__ import annotations

import asyncio

from consumers.config import TrainerConfig
from consumers.trainer import TrainerRole


def trainer(**cfg) -> TrainerRole:
    t = object.__new__(TrainerRole)  # only the fields _publish_due reads
    t.cfg = TrainerConfig(**cfg)
    t.step, t._published_step, t._round = 0, 0, None
    return t


def test_wait_mode_publishes_on_every_multiple_whatever_the_round():
    t = trainer(publish_every=2)
    assert [s for s in range(1, 9) if setattr(t, "step", s) or t._publish_due()] == [2, 4, 6, 8]


async def test_skip_mode_puts_a_publication_off_while_a_round_is_in_flight():
    t = trainer(publish_every=2, publish_busy="skip")
    t.step = 2
    assert t._publish_due()
    t._published_step, t._round = 2, asyncio.get_running_loop().create_future()
    t.step = 4
    assert not t._publish_due()  # due, but the round of step 2 still waits for acks
    t.step = 5
    assert not t._publish_due()
    t._round.set_result(None)
    assert t._publish_due()  # the first step after the round: steps 3-5 join this version
    t._published_step = 5
    t.step = 6
    assert not t._publish_due()  # publish_every counts from the last publication
    t.step = 7
    assert t._publish_due()
