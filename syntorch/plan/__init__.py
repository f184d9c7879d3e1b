"""`syntorch plan`: a search over the parallel layouts of a model on a cluster, ranked by syntorch's own
predicted step time and memory per rank.

space.py enumerates the layouts and prunes those that cannot run (counting each rule); evaluate.py predicts
one layout from probes it shares with others (a stage's kept layers across pipeline depths and DP degrees, its
end of backward and optimizer step across micro-batch sizes and recomputation); runner.py runs those
predictions here, in worker processes or on Ray; search.py ranks them; report.py prints the table and writes
plans.csv, plans.json and plans.png.
"""
