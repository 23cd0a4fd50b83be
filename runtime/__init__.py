"""What every role uses, below the roles: the lifecycle, metrics, telemetry, plugins and the role context.

Imports only the wire contract (``topics``); every role imports this layer, and nothing here imports a role,
``models`` or the app (``streamforge``).
"""
