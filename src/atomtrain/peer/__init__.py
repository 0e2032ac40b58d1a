"""Decentralized asynchronous training over hivemind: rounds, membership, state download."""
