"""The trainer: consumes Batches from Kafka, steps the policy, and publishes policy versions.

``trainer.py`` (``streamforge run trainer``) drives one rank (or rank 0 of many) through ``engine.py`` and
``step.py``; losses are plain functions (``losses.py``); new weights go out through ``weightsync``. A role layer: it
imports the wire (``topics``), the runtime, ``models`` and ``weightsync``, never another role or the app.
"""
