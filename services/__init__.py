"""Service roles: replicas of an environment (``run env``) or of a reward (``run reward``), registered on NATS.

A role layer beside ``producers``, ``buffer`` and ``consumers`` (none imports another): each replica serves one
environment or reward function and beats in the service layer (``runtime/services.py``) so callers can route to it.
"""
