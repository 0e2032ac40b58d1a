"""Benchmarks: each measures Atom against its baseline in the same run and returns a dict."""
