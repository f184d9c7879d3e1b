"""Seed 000's commands, verbatim, from a copy of examples/gpt3/ (the folder holds the scripts, as the seed's
did): each succeeds and leaves the files the seed names beside the scripts, which stay as they were."""
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "gpt3"
SEED = [  # (command, files the seed says it leaves)
    ("inference.py", ["run.json"]),
    ("inference.py --num_input_tokens 10 --num_output_tokens 20 --tp 1 --device cpu", ["run.json"]),
    ("inference.py --visualize_trace", ["tensor_trace_graph.png", "tensor_trace_graph.json"]),
    ("run_visualization.py --input tensor_trace_graph.json --output graph.svg --format svg", ["graph.svg"]),
    ("run_visualization.py --input tensor_trace_graph.json --output model.json --format chakra", ["model.json"]),
    ("run_visualization.py --input tensor_trace_graph.json --output graph.graphml --format graphml",
     ["graph.graphml"]),
    ("inference.py --tp 2 --visualize_trace",
     ["tensor_trace_graph.png", "tensor_comm_graph.png", "chakra/tensor_trace_chakra.json"]),
]


def test_the_seeds_commands_run_verbatim_from_the_example_folder(tmp_path):
    folder = tmp_path / "gpt3"
    shutil.copytree(EXAMPLES, folder)
    (folder / "notes.txt").write_text("the user's")  # a file of the user's beside the scripts
    scripts = {p.name: p.read_bytes() for p in folder.iterdir()}
    for command, files in SEED:
        done = subprocess.run([sys.executable, *command.split()], cwd=folder, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        for name in files:
            assert (folder / name).is_file() and (folder / name).stat().st_size > 0, f"{command} left no {name}"
    assert {name: (folder / name).read_bytes() for name in scripts} == scripts
