"""Environments for multi-turn episodes: the contract a generator plays against, OpenEnv environments, routing.

Above ``models``, below the roles: imports ``topics``, ``runtime`` and ``models`` only. A generator opens an
``EnvSession`` through an ``EnvRouter`` (``envs/api.py``); the session is sticky to one replica.
"""
