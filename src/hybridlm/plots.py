"""matplotlib for every figure hybridlm writes (a core dependency): the Agg backend, files only, no display."""


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
