"""The replay buffer: consumes Episodes, forms GRPO groups and Batches, and publishes them for the trainer.

``service.py`` (``streamforge run buffer``) is the process around the pure state machine of ``state.py`` and the
policies of ``policies.py``. A role layer: it imports the wire (``topics``), the runtime and ``weightsync``,
never another role or the app.
"""
