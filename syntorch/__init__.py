from syntorch.version import __version__

__all__ = ["__version__", "CommDebugMode"]


def __getattr__(name):
    # imported on first use, so `import syntorch` stays cheap (no torch)
    if name == "CommDebugMode":
        from syntorch.comm_debug import CommDebugMode
        return CommDebugMode
    raise AttributeError(f"module 'syntorch' has no attribute {name!r}")
