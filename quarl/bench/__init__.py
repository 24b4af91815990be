"""Benchmarks behind ``quarl bench ...``: each answers one question, writes JSON with
device, date and commit, and reports ratios measured in the same call."""
