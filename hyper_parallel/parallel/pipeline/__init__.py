"""Pipeline parallelism: an unmodified transformers causal LM cut into stages, run by torch's schedules."""
from .api import SCHEDULES, Pipeline, pipeline

__all__ = ["pipeline", "Pipeline", "SCHEDULES"]
