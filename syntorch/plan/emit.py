"""`syntorch plan --emit K`: the top K layouts of the (first) machine, each as the folder `syntorch trace` writes
for it (workload.py: a Chakra .et per rank, comm_groups.json, summary.json with the prediction), ready for
`syntorch validate` and ASTRA-sim."""
from pathlib import Path

from syntorch.config import torch_dtype
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.search import Result
from syntorch.simulate.prediction import predict_training
from syntorch.workload import trace_workload, write_workload


def emit(result: Result, k: int, out: Path, dtype: str, profile: str, attention: str, progress: bool) -> list[str]:
    """Writes the folders into `out` (inside the caller's whole-or-nothing output folder); returns their names."""
    hw, names = result.hws[0], []
    for row in result.best(hw.name, k):
        plan = TrainPlan(**row["plan"])
        workload = trace_workload(result.config, plan, torch_dtype(dtype), hw, schedule=True, profile=profile,
                                  attention=attention)
        prediction = predict_training(workload.probes, workload.source, plan, hw, profile, attention)
        name = f"top{row['rank']}_" + row["name"].replace(" ", "_")
        write_workload(workload, out / name, "module", progress=progress, prediction=prediction)
        names.append(name)
    return names
