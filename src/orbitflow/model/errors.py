class ModelLoadError(Exception):
    """A model could not be found or read; the message is one line naming the path, fit for a CLI."""
