"""Profiler capture of real runs and their conversion to Chakra .et with the official mlc-chakra tools.

profile.py   torch.profiler with the execution-trace observer (host JSON) and Kineto (device JSON)
traces.py    reading, checking and repairing the captured JSON traces
convert.py   link (chakra_trace_link) + convert (chakra_converter PyTorch) + repair.py, per rank
repair.py    what the official tools leave wrong for ASTRA-sim on CPU/gloo captures
"""
