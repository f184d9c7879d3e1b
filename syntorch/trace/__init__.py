"""Tracing: run anything under a Tracer and get a TraceGraph (graph.py) of its ops and collectives."""
from syntorch.trace.graph import COLLECTIVES, LEVELS, RankTraces, TraceGraph
from syntorch.trace.tracer import Tracer
from syntorch.trace.generation import trace_generation, trace_run

__all__ = ["COLLECTIVES", "LEVELS", "RankTraces", "TraceGraph", "Tracer", "trace_generation", "trace_run"]
