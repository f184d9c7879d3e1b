"""Tracing: run anything under a Tracer and get a TraceGraph (graph.py) of its ops and collectives."""
from syntorch.trace.graph import COLLECTIVES, LEVELS, RankTraces, TraceGraph

__all__ = ["COLLECTIVES", "LEVELS", "RankTraces", "TraceGraph"]
