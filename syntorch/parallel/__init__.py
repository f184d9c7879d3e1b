"""Parallelism as plans applied to a plain model: mesh, collectives, TP/PP/DP."""
