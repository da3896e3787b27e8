"""Fault-injection kit, by concern: traffic, worker processes, a client-cutting proxy, accounting, poison
records (common: what they share)."""
