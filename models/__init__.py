"""Policies and tasks that generators and trainers share: the tiny model, pretrained models by name, toy tasks.

Below the roles and above the runtime: imports ``topics`` and ``runtime`` only.
"""
