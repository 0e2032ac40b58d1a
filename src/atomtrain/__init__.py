"""Atom: train models larger than your GPU on the machines you have."""
