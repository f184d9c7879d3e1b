"""The cross-rank simulator: discrete events over per-rank programs (engine.py), built from TraceGraphs
once per rank kind (graphs.py), from pipeline steps for training at scale (steps.py) or from Chakra files
(chakra_files.py); predictions and timelines (predict.py)."""
