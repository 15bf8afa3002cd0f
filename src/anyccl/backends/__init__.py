"""Transports: each module knows how bytes move between ranks, not which bytes go where."""
