"""Experiment suites: run configs over seeds on one machine, summarised into docs/results/."""
