"""The sans-I/O core: decisions over plain rows, and operations as generators of named statements.

Nothing in this package opens a socket, sleeps or awaits. The stores drive the flows.
"""
