"""Training: the loop and what it calls (resume, evaluation, throughput, metrics, checkpoints).
What it compiles (model, plan, train and eval steps) is built by moetext.program."""

from moetext.train.loop import run

__all__ = ["run"]
