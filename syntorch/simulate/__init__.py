"""The one simulator every prediction goes through (trace/cost.py gives each op or kernel its duration; this
composes them): discrete events over per-rank programs on a compute stream and a stream per communicator
(engine.py), built from TraceGraphs once per rank kind (graphs.py), from pipeline steps for training at
scale (steps.py) or from Chakra files (chakra_files.py); what a run says (stats.py), predictions
(predict.py) and their Perfetto timelines (timeline.py)."""
