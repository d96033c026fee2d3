"""Scaling-law fits over a table of training runs (`python -m launch.scaling fit`)."""
