__version__ = "0.1.0"


def __getattr__(name):
    # imported on first use, so `import syntorch` stays cheap (no torch)
    if name == "CommDebugMode":
        from syntorch.comm_debug import CommDebugMode
        return CommDebugMode
    raise AttributeError(f"module 'syntorch' has no attribute {name!r}")
