"""Generators and the feeder: the roles that put prompts on the bus and turn them into scored Episodes.

``generator.py`` (``streamforge run generator``): prompts in from Kafka, vLLM sampling, rewards, Episodes out, new
weights in through ``weightsync``. ``feeder.py`` (``streamforge run feeder``): a local prompt source into the
``prompts`` topic. A role layer: it imports the wire (``topics``), the runtime, ``models`` and ``weightsync``,
never another role or the app (``streamforge``).
"""
