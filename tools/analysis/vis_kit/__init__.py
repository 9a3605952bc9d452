"""Pieces of ``tools/analysis/visualize.py``: the model and its input (:mod:`.model`), what
the backbone computes, read with hooks (:mod:`.capture`), where tokens, windows and shift
regions lie (:mod:`.geometry`), and the pictures (:mod:`.figures`, :mod:`.pictures`)."""


class VisualizeError(ValueError):
    """A bad argument or an unsupported model; the message names the problem and the valid
    choices (the CLI prints it as ``error: <message>``)."""
