"""MLCommons Chakra execution traces, the form ASTRA-sim runs: one mapping from a TraceGraph (nodes.py), one
comm-group id scheme (groups.py), one writer (writer.py, with the fast per-rank path), one reader (reader.py)
and the simulator's rules (validator.py). Export, the cluster-scale workload, real captures and `syntorch
validate` all go through these."""
