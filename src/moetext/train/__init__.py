"""Training: state, jitted step, metrics, and the loop."""

from moetext.train.loop import build, run

__all__ = ["build", "run"]
