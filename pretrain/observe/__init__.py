"""Seeing inside a run: the step profiler, Megatron-Core timer ranges, experiment trackers
(MLflow, W&B), the hang watchdog and the straggler report.

Each piece is built by `pretrain.loop.setup` from its config section and called from the
loop in plain sight (no callbacks); everything is off or free when not configured.
"""
